"""Measuring mappers: continuation agreement and timing (``continuation``), multiple-choice sets
(``tasks``, ``taskeval``), long-context recall (``longctx``), the no-information control
(``control``), resumable per-item results (``cache``) and figures (``plots``)."""
