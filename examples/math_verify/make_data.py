"""Write a GSM8K-style JSONL of generated word problems: `problems.jsonl` (300 lines).

Each line: {"id": "gsm-000", "prompt": [{"role": "user", "content": "..."}], "answer": "42",
"solution": "..."}. Answers are integers, fractions (`\\frac{3}{4}`) or decimals, as math-verify
compares them (`1/2`, `0.5` and `\\frac{1}{2}` are the same answer). The `solution` column is a worked
solution ending in `\\boxed{answer}`, which `tests/e2e/test_examples.py` feeds back as a completion that
must score 1.0. Run from the repository root: python -m examples.math_verify.make_data
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards")


def _tex(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def problem(rng: random.Random) -> tuple[str, Fraction, str]:
    """(question, answer, worked solution) of one of four kinds."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {name} have now?"
        ans = Fraction(a + b - c)
        sol = f"{a} + {b} - {c} = {a + b - c}."
    elif kind == 1:
        q = f"{name} packs {a * c} {item} into {c} equal boxes. How many {item} are in each box?"
        ans = Fraction(a)
        sol = f"{a * c} / {c} = {a}."
    elif kind == 2:
        q = f"{name} eats {c} of {a + c} slices of a cake cut into equal slices. What fraction of the cake is eaten?"
        ans = Fraction(c, a + c)
        sol = f"{c} out of {a + c} slices is {c}/{a + c} = {_tex(ans)}."
    else:
        b = rng.randint(1, 4 * a - 1)
        q = f"A pack of {item} costs {a} dollars and {name} has {b} dollars less than 4 packs cost. "
        q += f"How much money does {name} have?"
        ans = Fraction(4 * a - b)
        sol = f"4 * {a} - {b} = {4 * a - b}."
    return q, ans, sol


def main() -> None:
    rng = random.Random(0)
    lines = []
    for i in range(300):
        q, ans, sol = problem(rng)
        answer = _tex(ans)
        prompt = [{"role": "user", "content": q}]  # the config adds a system prompt
        solution = f"{sol} \\boxed{{{answer}}}"
        lines.append({"id": f"gsm-{i:03d}", "prompt": prompt, "answer": answer, "solution": solution})
    out = Path(__file__).with_name("problems.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
