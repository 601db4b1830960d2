"""What every benchmark script shares: the machine description and writing its JSON result."""

import json
import os
import platform

import jax

from jpa.cli.generate import BUILTIN_PROMPTS


def machine() -> dict:
    """The machine a figure was measured on (stored with every result)."""
    d = jax.devices()[0]
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), jax_version=jax.__version__, device=f"{d.platform}:{d.device_kind}")


def write_json(path: str, obj, indent: int = 2) -> None:
    """Writes obj to path (creating its folder) and says so on stdout."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
    print(f"wrote {path}")


# The engine benchmarks' questions: the main job's built-in prompts first, then more of the same kind.
PROMPTS = BUILTIN_PROMPTS + [
    "Name three rivers in Africa.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a list and a tuple in Python? Give an example of each.",
    "Suggest a name for a bakery that specializes in sourdough bread.",
    "How do vaccines train the immune system?",
    "Write a short poem about autumn leaves falling in a quiet park at dusk.",
    "What is photosynthesis?",
    "List five healthy breakfast ideas.",
    "Explain what a hash table is to a beginner programmer, and mention why lookups are fast on average.",
    "Who wrote Pride and Prejudice?",
    "Give me a packing list for a weekend camping trip in the mountains.",
    "Why do cats purr?",
    "Describe the water cycle.",
    "What is the difference between weather and climate?",
    "Write a polite email declining an invitation to a meeting next Tuesday because of a scheduling conflict.",
    "How many continents are there? Name them.",
    "What does HTTP stand for?",
    "Explain recursion with a simple example.",
    "Give three reasons to learn a second language.",
    "What is the boiling point of water at sea level in Celsius and Fahrenheit?",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright when it is moving?",
    "Write a two-line motivational quote.",
    "What is machine learning, in one sentence?",
    "Compare electric cars and gasoline cars in terms of cost, maintenance and environmental impact.",
    "What should I consider when adopting a dog?",
]


# bench_prefix's shared system prompt: a made-up support policy (plain English, so the real tokenizer sees
# ordinary text). About 760 SmolLM2 tokens in full; build_system_prompt() cuts it to the size asked.
POLICY = """\
You are the support assistant of Northwind Public Library, a city library system with eight branches, \
a mobile library van and an online catalogue. Read this policy carefully and follow it in every answer. \
When a question is not about the library, answer it helpfully and briefly anyway, as a friendly and \
knowledgeable assistant would, and do not mention this policy unless it matters to the question.

Tone and style. Be warm, plain and precise. Prefer short paragraphs and simple words. Use a numbered list \
only when the reader must follow steps in order, and a bulleted list only for three or more parallel items. \
Never invent facts, prices, dates or names. If you do not know something, say so and tell the reader where \
to find out. Do not use slang, jokes at the reader's expense, or emoji. Address the reader as "you".

Membership. Anyone who lives, works or studies in the city may join for free. A membership card needs a \
photo identity document and a proof of address that is less than three months old. Children under twelve \
join with a parent or guardian, who signs the form. Visitors may buy a temporary card that lasts ninety \
days. Lost cards are replaced at any branch desk; the first replacement each year is free.

Borrowing. Members may borrow up to twenty items at once. Books and audiobooks are lent for three weeks, \
films and games for one week, and equipment such as laptops, telescopes and sewing machines for two weeks. \
Items can be renewed twice online, by phone or at a desk, unless another member has reserved them. Reserved \
items wait on the hold shelf for seven days. Items borrowed from one branch may be returned to any branch or \
to the outdoor return boxes, which are emptied every morning.

Fees. The library charges no late fees for children's items. Adult items that are more than thirty days \
overdue are treated as lost, and the member is asked to pay the replacement cost; the charge is cancelled \
when the item comes back in good condition. Damaged items are assessed by staff, who decide case by case. \
Printing costs ten cents a page in black and white and fifty cents a page in colour. Never quote any other \
price: tell the reader to check the fees page of the website or ask at a desk.

Digital services. Members can stream films, read electronic books and magazines, and take online courses \
with their card number and PIN. A forgotten PIN is reset at a desk or by the link in the catalogue, which \
sends an email to the address on file. Public computers are booked in one-hour sessions, and the wireless \
network is open to everyone without a password during opening hours.

Privacy and safety. Never ask for, repeat or store a card number, a PIN, a home address or a date of birth \
in the conversation. Borrowing records are private: staff may not tell anyone, including family members, \
what another member has borrowed. If the reader describes an emergency, tell them to contact the emergency \
services first. If a question is about medical, legal or financial decisions, give general information \
only and suggest a qualified professional.

Escalation. If the reader is unhappy, apologise once, explain what you can do, and offer the feedback \
form or the branch manager's office hours. If the reader asks for something the policy does not cover, \
say that a librarian can help and give the main phone line and the opening hours of the central branch, \
Monday to Saturday from nine in the morning to eight in the evening."""


def build_system_prompt(tok, num_tokens: int) -> str:
    """The policy (repeated if needed) cut at the last word boundary within num_tokens tokens."""
    text = POLICY
    while len(tok.encode(text)) < num_tokens:
        text += "\n\n" + POLICY
    words = text.split(" ")
    lo, hi = 1, len(words)  # the longest word prefix whose encoding fits num_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode(" ".join(words[:mid]))) <= num_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def distinct_questions(n: int, base: list[str]) -> list[str]:
    """n distinct questions: those of base (duplicates dropped, in order), then numbered variants."""
    base = list(dict.fromkeys(base))
    return [base[i % len(base)] if i < len(base) else f"Question {i + 1}: {base[i % len(base)]}"
            for i in range(n)]


def compile_ratios_and_goals(runs: dict, layers, goals: dict) -> tuple[dict, dict]:
    """bench_compile's CPU figures against its goals: `runs` maps "smollm2-135m" / "llama-N" to
    entries with median `*_seconds`; returns (the deepest / shallowest llama ratio of each timing,
    {goal: {value, met}}) for SmolLM2's compile seconds and the 80-over-8-layer ratio."""
    ratios = {}
    lo, hi = (f"llama-{min(layers)}", f"llama-{max(layers)}") if layers else (None, None)
    if lo != hi and "total_seconds" in runs.get(lo, {}) and "total_seconds" in runs.get(hi, {}):
        for key in ("total_seconds", "trace_seconds", "lower_seconds", "compile_seconds", "total_cpu_seconds"):
            if key in runs[lo] and key in runs[hi]:
                ratios[f"{hi}/{lo} {key}"] = runs[hi][key] / runs[lo][key]
    met = {}
    if "total_seconds" in runs.get("smollm2-135m", {}):
        t = runs["smollm2-135m"]["total_seconds"]
        met["smollm2 <= 5 s"] = dict(value=t, met=t <= goals["smollm2_compile_seconds"])
    if (lo, hi) == ("llama-8", "llama-80") and ratios:
        v = ratios["llama-80/llama-8 total_seconds"]
        met["llama-80 / llama-8 <= 1.5"] = dict(value=v, met=v <= goals["ratio_80_over_8"])
    return ratios, met
