"""Random constraints for the structured-output tests (tests/test_structured.py) and their checks.

Every generator takes a numpy Generator and returns a constraint whose outputs are bounded (string
lengths, integer ranges, array sizes, no additional properties), so a random model that knows
nothing can only finish by meeting it.
"""

import ast
import json
import re

# Integer arithmetic, two levels of parentheses at most (a random model would nest forever).
ARITHMETIC = r"""
start: expr
expr: term (ADD term)~0..2
term: factor (MUL factor)~0..2
factor: NUMBER | "(" inner ")"
inner: NUMBER ((ADD | MUL) NUMBER)~1..2
ADD: "+" | "-"
MUL: "*"
NUMBER: /0|[1-9][0-9]{0,2}/
"""

WORDS = ["red", "green", "blue", "x", "yes", "no", "alpha", "b2", "q_z"]


def random_schema(rng, depth: int = 0) -> dict:
    """An object schema: 1-3 required properties of random kinds (bounded integers and numbers,
    booleans, string enums, short strings, bounded arrays, a nested object)."""
    props = {}
    for i in range(int(rng.integers(1, 4))):
        kinds = ["integer", "number", "boolean", "enum", "string", "array"] + (["object"] if depth < 1 else [])
        kind = kinds[int(rng.integers(len(kinds)))]
        if kind == "integer":
            lo = int(rng.integers(-50, 50))
            s = {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 500))}
        elif kind == "number":
            lo = float(rng.integers(-10, 10))
            # multipleOf bounds the fraction digits (a random model could write 0.1111... forever)
            s = {"type": "number", "minimum": lo, "maximum": lo + 20.0, "multipleOf": 0.25}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": sorted(set(rng.choice(WORDS, int(rng.integers(1, 4))).tolist()))}
        elif kind == "string":
            s = {"type": "string", "minLength": int(rng.integers(0, 2)), "maxLength": int(rng.integers(2, 6))}
        elif kind == "array":
            lo = int(rng.integers(0, 2))
            s = {"type": "array", "items": {"enum": WORDS[:3]} if rng.random() < 0.5 else
                 {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": lo, "maxItems": lo + int(rng.integers(1, 3))}
        else:
            s = random_schema(rng, depth + 1)
        props[f"k{i}_{kind}"] = s
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def random_regex(rng) -> str:
    """A bounded regex built from classes, literals, alternation and counted repetition (syntax that
    Python's `re` and Rust's `regex` read alike)."""
    pieces = []
    for _ in range(int(rng.integers(2, 5))):
        k = int(rng.integers(4))
        lo = int(rng.integers(0, 3))
        if k == 0:
            pieces.append(f"[a-{'cfz'[int(rng.integers(3))]}]{{{lo},{lo + int(rng.integers(1, 4))}}}")
        elif k == 1:
            pieces.append(f"[0-9]{{{max(lo, 1)},{max(lo, 1) + 2}}}")
        elif k == 2:
            pieces.append("(" + "|".join(rng.choice(WORDS, 2, replace=False).tolist()) + ")")
        else:
            pieces.append(re.escape(str(rng.choice(["-", "@", ".", ":", "/"]))))
    return "".join(pieces)


def random_choices(rng) -> list[str]:
    return sorted(set(rng.choice(WORDS + ["two words", "a-b", "ünï"], int(rng.integers(2, 5))).tolist()))


def is_arithmetic(text: str) -> bool:
    """text parses as an arithmetic expression of integers, + - * and parentheses (Python's parser)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.UnaryOp)
    return all(isinstance(n, ok) for n in ast.walk(tree))


def check_json(text: str, schema: dict) -> None:
    """Raises unless text is JSON that validates against schema."""
    import jsonschema

    jsonschema.validate(json.loads(text), schema)
