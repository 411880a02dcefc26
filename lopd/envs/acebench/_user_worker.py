"""The process that runs ACEBench's simulated user: a local chat model, greedy replies.

Started by :mod:`lopd.envs.acebench.user` as ``python _user_worker.py``. It reads JSON lines on
stdin and answers each with one JSON line on stdout:

* first ``{"model": PATH, "device": DEVICE}``: loads the tokenizer and the model (nothing is
  downloaded); answers ``{"ready": true}`` or ``{"error": TEXT}``;
* then ``{"messages": [...], "max_new_tokens": N}``: renders the conversation with the model's
  chat template (thinking off where the template has the switch) and answers
  ``{"text": REPLY}`` (greedy, special tokens dropped) or ``{"error": TEXT}``.

It exits at the end of its input. It imports no part of lopd, and nothing of lopd imports it
(transformers takes seconds to import: only this process pays for it).
"""

import json
import os
import sys

import torch
import transformers


def _load(path: str, device: str):
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("its tokenizer has no chat template")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.to(device).eval()
    return tokenizer, model


def _reply(tokenizer, model, messages: list, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_tensors="pt"
    )
    if not isinstance(ids, torch.Tensor):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    ids = ids.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # the libraries' prints never reach the protocol
    loaded = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if loaded is None:
                loaded = _load(request["model"], request["device"])
                answer = {"ready": True}
            else:
                text = _reply(*loaded, request["messages"], int(request["max_new_tokens"]))
                answer = {"text": text}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    main()
