"""The core run path, one module per step (read ``execute.py`` top to bottom):

request -> prepare (policy, cached and revalidated; the plan built once) -> launch
(cold or launcher: linux/'s one choice) -> supervise (pipes, pty, timeout, signals,
reports) -> record (run.json, audit, the Result).

Nothing here imports the speed layer (the CLI server, the on-disk prepared-run
cache) or the CLI: the speed layer plugs in through ``prepare.set_cache``.
"""
