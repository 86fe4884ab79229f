"""Fitting a mapper: the resumable fit over the core (``fit``), fitting by model names (``job``),
on several ranks with torch.distributed (``distributed``), and what a fit will cost (``plan``)."""
