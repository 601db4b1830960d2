"""`jpa COMMAND [args]`: the console entry point installed with the package (pyproject `[project.scripts]`)."""

import importlib
import sys

# command -> (module with main(argv), one line of help). Modules are imported only when run, so
# `jpa --help` and a bad command cost no JAX import.
COMMANDS = {
    "generate": ("jpa.cli.generate", "generate text with continuous batching (the main job; SmolLM2 by default)"),
    "serve": ("jpa.cli.serve", "an OpenAI-compatible server (needs the `serve` extra)"),
    "serve-dp": ("jpa.cli.serve_dp", "N server replicas behind vllm-router (needs the `serve` and `router` extras)"),
    "tools": ("jpa.tools.cli", "deviceless GPU compile and traffic tools, the mutation check (`jpa tools --help`)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return ("usage: jpa COMMAND [args]   (jpa COMMAND --help for its flags)\n\ncommands:\n" + "\n".join(lines)
            + "\n  --version   print jpa's version")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        import jpa

        print(f"jpa {jpa.__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"jpa: error: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
