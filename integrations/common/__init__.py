"""Pieces shared by mori-suite's framework adapters (no framework imports here).

* :mod:`.net`           -- this host's address, wildcard resolution
* :mod:`.extra_config`  -- typed, bounded reads of a connector's ``extra`` dict
* :mod:`.engine_setup`  -- an IO engine with the transports a machine offers, memory registration
* :mod:`.segments`      -- page/slot indices -> byte segments, one-call batch writes
* :mod:`.control_codec` -- bounded msgspec control messages, HMAC-authenticated with a shared secret
* :mod:`.log_limit`     -- rate-limited logs of bad network input, the start-up warning when unauthenticated
"""
