"""transformers' and huggingface_hub's own progress bars ("Loading weights", downloads) for the in-process runtime:
``local_job(spec, progress=False)`` turns them off while its parts load models, and only then; a verbose console
(``contract.console.route_logs(..., verbose=True)``, :data:`contract.console.VERBOSE_ENV` "1") keeps them.

The switch is the libraries' documented one (``transformers.utils.logging.disable_progress_bar``, which also turns
off huggingface_hub's bars); it is process-wide, so :func:`library_progress_bars` restores both libraries' previous
settings when its block ends: code around the job (a notebook's own ``from_pretrained``) keeps its bars.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from contract.console import VERBOSE_ENV

__all__ = ["library_progress_bars"]


@contextmanager
def library_progress_bars(shown: bool) -> Iterator[None]:
    """Inside the block, transformers' and huggingface_hub's progress bars are shown when ``shown`` and off
    otherwise (``shown=True`` changes nothing: a bar a library or its environment turned off stays off). Both
    settings are restored afterwards, also when the block raises. A verbose console shows them whatever ``shown``."""
    if shown or os.environ.get(VERBOSE_ENV) == "1":
        yield
        return
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    transformers_shown, hub_shown = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if transformers_shown:
            hf_logging.enable_progress_bar()  # turns huggingface_hub's back on too
        if hub_shown:
            hub_utils.enable_progress_bars()
        elif transformers_shown:
            hub_utils.disable_progress_bars()
