"""The speed layer: optional, above the core, never imported by it.

* ``client`` and ``server``: a `stockade run` handed to the user's warm CLI server, which
  forks a supervisor that takes on the client's whole context and runs the same CLI code
  (``stockade.cli.main``). ``STOCKADE_SERVER=0`` turns it off: every run in-process.
* ``warm``: prepared runs kept on disk between CLI processes, revalidated per run
  (the core's prepared-run cache hook). ``STOCKADE_WARM=0`` turns it off.

With both off every run takes the core's path from scratch, and the suite passes so.
"""
