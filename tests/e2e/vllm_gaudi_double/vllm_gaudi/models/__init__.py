"""Double of ``vllm_gaudi/models/__init__.py``: vllm-gaudi registers HPU model classes here."""


def register_model():
    return None
