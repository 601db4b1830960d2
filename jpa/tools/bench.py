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
