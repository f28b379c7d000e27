"""The compensator: APScheduler jobs that converge whatever the fast path left behind.

One module per job, each with ``run_once(runtime) -> int`` (how much it did);
``compensator/__main__.py`` only registers them with the scheduler.
"""
