"""NxD's ``neuronx_distributed.utils.logger``: one configured logger, rank 0 only by default.

``NXD_LOG_LEVEL`` sets the level (``debug``/``trace``, ``info`` (default), ``warning``,
``error``, ``fatal``, ``off``); ``NXD_LOG_HIDE_TIME=1`` drops the timestamp.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

__all__ = ["get_log_level", "get_logger"]

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.FATAL,
    "off": logging.FATAL + 1,
}


def get_log_level() -> int:
    """The level named by ``NXD_LOG_LEVEL`` (default ``info``); an unknown name is an error."""
    name = os.environ.get("NXD_LOG_LEVEL", "info").lower()
    if name not in _LEVELS:
        raise ValueError(f"NXD_LOG_LEVEL must be one of {sorted(_LEVELS)}, got {name!r}")
    return _LEVELS[name]


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    """Lets records through on global rank 0 only (the rank is read when a record is made)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _global_rank() == 0


def get_logger(name: str = "neuronx_distributed", rank0_only: bool = True) -> logging.Logger:
    """A stdout logger named ``name`` (configured once), silent off rank 0 when ``rank0_only``."""
    logger = logging.getLogger(name + ("[0]" if rank0_only else "[]"))
    if getattr(logger, "_nxd_configured", False):
        return logger
    hide_time = os.environ.get("NXD_LOG_HIDE_TIME", "").lower() in ("1", "true")
    stamp = "" if hide_time else "%(asctime)s "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[{stamp}%(levelname).1s %(name)s] %(message)s"))
    logger.handlers = [handler]
    logger.setLevel(get_log_level())
    if rank0_only:
        logger.addFilter(_RankZeroFilter())
    logger.propagate = False
    logger._nxd_configured = True  # type: ignore[attr-defined]
    return logger
