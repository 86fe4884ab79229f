"""Fitting a mapper: the resumable fit over the core (``fit``, on one ``prepared.PreparedFit``), fitting by
model names with the early refusals (``job``), on several ranks with torch.distributed (``distributed``,
started by ``torchrun``), and what a fit will cost (``plan``)."""
