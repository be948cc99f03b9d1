"""Starting a sandbox for a Plan (above plan.py, below the core run path).

``start.start`` is the one choice between a pre-spawned launcher (``launcher``) and
a cold start; ``lower`` turns a Plan into the C core's structs (linux/native.py
owns the C core itself and knows no Plan)."""
