"""``zero3_init_flag``: switch on partitioned ``from_pretrained`` in Accelerate workers.

With ``zero_stage: 3`` and ``zero3_init_flag: true`` in the ``zero_config:`` section,
every ``from_pretrained`` in the worker builds the model unallocated
(:mod:`zero_strategy.integrations.pretrained`) and ``accelerator.prepare`` loads each rank's slice.
Active in a worker whose launcher exported such a section (the start-up hook calls
:func:`install_from_environment` when ``transformers.modeling_utils`` is imported, so
it does not matter whether the script loads the model before or after creating its
Accelerator) and from the moment a ``ZeroAccelerator`` with such a section is created.
"""
from __future__ import annotations

import logging
import os

from .. import pretrained as _pretrained
from . import settings as _settings

_log = logging.getLogger(__name__)


def enable(settings) -> None:
    """Activate partitioned ``from_pretrained`` when ``settings`` ask for it (stage 3)."""
    if settings is None or not settings.zero3_init_flag:
        return
    stage = int(settings.engine.get("stage", 2))
    if stage != 3:
        # As with DeepSpeed: only stage 3 partitions parameters, so there is nothing to
        # build partitioned; the model is built whole and partitioned by prepare.
        _log.info("zero_config.zero3_init_flag has no effect at zero_stage %s (only stage 3 partitions parameters)", stage)
        return
    _pretrained.activate()


def install_from_environment(module=None) -> None:
    """Start-up hook for ``transformers.modeling_utils`` in a launched worker."""
    if os.environ.get(_settings.ENV_VAR):
        enable(_settings.from_environment())
