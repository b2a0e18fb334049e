"""Knowledge distillation: teachers, losses, feature capture by hooks, and the ``distill`` modifier.

The public entry point is :class:`distillation.api.Distiller` (re-exported as ``compress.Distiller``);
recipes use ``type: distill`` (distillation.modifiers).
"""
