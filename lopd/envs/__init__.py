"""Task worlds with verifiers: tool-use worlds, the coding sandbox, JSONL loaders."""

from lopd.envs.base import (
    CODING_SYSTEM_PROMPT,
    TASK_COMPLETED,
    TOOL_USE_SYSTEM_PROMPT,
    Env,
    ToolCall,
    ToolCallParseError,
    is_task_completed,
    parse_tool_calls,
    strip_thinking,
)

__all__ = [
    "CODING_SYSTEM_PROMPT",
    "TASK_COMPLETED",
    "TOOL_USE_SYSTEM_PROMPT",
    "Env",
    "ToolCall",
    "ToolCallParseError",
    "is_task_completed",
    "parse_tool_calls",
    "strip_thinking",
]
