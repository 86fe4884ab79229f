"""The math core: RoPE strip/apply (``rope``), K/V capture (``capture``), mergeable sufficient
statistics (``stats``), the closed-form probe and ridge solves (``solve``) and the ``Mapper`` that
applies them. Imports nothing from store, hub, serving or cli."""
