"""Run inside Optimum's own virtualenv (Optimum pins an older transformers than the project's): load an
export folder with ``ORTModelForCausalLM.from_pretrained`` as a user would and print, as JSON, the
greedy tokens it generates for a prompt and every warning it raised while loading and generating.

    python _optimum_worker.py FOLDER FILE_NAME PROMPT_IDS_JSON MAX_NEW_TOKENS
"""

from __future__ import annotations

import json
import logging
import sys
import warnings


def main() -> None:
    folder, file_name, prompt_json, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                logged.append(record.getMessage().splitlines()[0])

    logging.getLogger().addHandler(Keep())
    for name in ("optimum", "transformers"):
        logging.getLogger(name).addHandler(Keep())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ORTModelForCausalLM.from_pretrained(folder, file_name=file_name, use_cache=True, use_io_binding=False)
        ids = torch.tensor([json.loads(prompt_json)], dtype=torch.long)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             min_new_tokens=new)
    import optimum.version
    import transformers

    print(json.dumps({"tokens": out[0].tolist(), "optimum": optimum.version.__version__,
                      "transformers": transformers.__version__,
                      "warnings": sorted({str(w.message).splitlines()[0] for w in caught} | set(logged))}))


if __name__ == "__main__":
    main()
