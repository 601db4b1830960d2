"""The `jpa` command (application layer): `jpa generate`, `jpa serve`, `jpa serve-dp` (also
`python -m jpa ...`). Each subcommand is a module with `main(argv) -> exit code`; the flags they share
are `jpa.args.EngineArgs`, and the wiring is `jpa.llm.engine_from_args`."""
