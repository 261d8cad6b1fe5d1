"""Pieces shared by mori-suite's framework adapters (no framework imports here).

* :mod:`.net`           -- this host's address, wildcard resolution
* :mod:`.extra_config`  -- typed, bounded reads of a connector's ``extra`` dict
* :mod:`.engine_setup`  -- an IO engine with the transports a machine offers, memory registration
* :mod:`.segments`      -- page/slot indices -> byte segments, one-call batch writes
* :mod:`.control_codec` -- bounded msgspec control messages in small frames, HMAC-authenticated with a
                           shared secret and bound to their recipient
* :mod:`.zmq_setup`     -- ZMQ sockets of the control planes: frame/queue bounds, CURVE per connection
* :mod:`.log_limit`     -- logs of bad network input bounded per source and in total, the start-up warning
                           when unauthenticated
"""
