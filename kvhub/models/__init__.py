"""Models: specs to loaded models (``loading``: known models, local dirs, .gguf, Hub ids), fetching
and converting the known models (``fetch``), configs read offline (``configs``), and what a mapper is valid
for (``fingerprint``)."""
