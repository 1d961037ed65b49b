"""The language-model area (pFedDPO): model loading and LoRA (``model.py``), preference data (``preference.py``)
and the DPO objective (``dpo.py``). Install with ``scripts/install.sh --lm``.

Heavy imports (transformers, peft, gguf) happen inside the functions that need them, so that checking a config
or running an image method never imports them.
"""
