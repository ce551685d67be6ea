"""The progress bar of a layer-by-layer run: one step per decoder layer, on rank 0 only."""

from __future__ import annotations

from typing import Any


def progress_bar(desc: str, total: int, initial: int, enabled: bool) -> Any:
    """A tqdm bar of ``total`` layers starting at ``initial`` (a resumed run's completed layers), or None when not
    ``enabled``. Close it before printing an error, so that the error starts on a line of its own."""
    if not enabled:
        return None
    import threading

    from tqdm.auto import tqdm

    # A thread lock, not tqdm's default multiprocessing one: a rank leaves with os._exit (launcher), which would leave
    # that semaphore registered with the resource tracker ("leaked semaphore objects").
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc=desc, unit="layer")
