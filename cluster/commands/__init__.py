"""dspark_serve.cluster.commands: the `dspark-serve` command (cli.py) and the subcommands with modules of their own
(demo, bench); `python -m dspark_serve.cluster.commands` runs it."""
