"""Launching: starting this node's processes, watching them and stopping them all (a composition root,
like server/). backend.Backend starts the worker ranks and the scheduler (child.py is what each runs
first); node.py serves HTTP over them, or runs a node's ranks alone; data_parallel.py runs N servers
behind SGLang's router. process.Process is the one process wrapper, ports.py the one port helper.
HTTP itself is radixrt/server/; each process's loop stays in its package (worker/worker_proc.py,
scheduler/scheduler_proc.py)."""
