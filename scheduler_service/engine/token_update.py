"""What the engine hands the serving side per request and step: token ids, never text.

The class lives in scheduler_service/core/step_result.py: the scheduler makes it directly in
update_from_output (one object per request and step, not a scheduler update plus a copy).
"""
from __future__ import annotations

from scheduler_service.core.step_result import TokenUpdate

__all__ = ["TokenUpdate"]
