"""Framework adapters of mori-suite, installed as ``mori_integrations``.

Each subpackage translates one framework's transfer/EP interface into
``mori_core`` calls and is registered through that framework's entry point.
"""
