"""Write the reverse-digits task as chat-message prompts: `train.jsonl` and `eval.jsonl` (held out).

Each line: {"id": "rd-00000", "prompt": [{"role": "user", "content": "123"}], "answer": "321"}.
The eval file draws only the digit tasks' held-out strings (`tasks.is_held_out`), so no eval prompt
is ever trained on. Run from the repository root: python -m examples.chat_model.make_data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from single_controller.data.tasks import is_held_out

HERE = Path(__file__).parent


def rows(num: int, num_digits: int, seed: int, held_out: bool, prefix: str) -> list[dict]:
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < num:
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        if is_held_out(digits) != held_out or (held_out and digits in seen):
            continue
        seen.add(digits)
        prompt = [{"role": "user", "content": digits}]
        out.append({"id": f"{prefix}-{len(out):05d}", "prompt": prompt, "answer": digits[::-1]})
    return out


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-train", type=int, default=1000)
    p.add_argument("--num-eval", type=int, default=64)
    p.add_argument("--num-digits", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE)
    a = p.parse_args()
    write(a.out / "train.jsonl", rows(a.num_train, a.num_digits, 0, False, "rd"))
    write(a.out / "eval.jsonl", rows(a.num_eval, a.num_digits, 1, True, "rd-eval"))


if __name__ == "__main__":
    main()
