"""Training of drafts: distillation of a draft from its target (distill.py)."""
