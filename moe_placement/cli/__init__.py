"""The ``moe-placement`` command line: the top floor, importing every package; nothing imports it.

Run it as ``moe-placement`` (installed script) or ``python -m moe_placement``.
"""
