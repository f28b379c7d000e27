"""Everything paysync says to RabbitMQ: the one package that imports pika.

- ``connection``: connection parameters, one heartbeat and timeout policy for every process;
- ``topology``: the callback queue and its dead-letter queue, the events exchange;
- ``publisher``: the gateway's callback publisher (asynchronous confirms, never blocks a request);
- ``consume``: the consumer's loop (prefetch, manual ack, reconnect, graceful stop) around a plain handler;
- ``events``: the domain-event publisher the compensator's ``publish_events`` job uses.

Nothing here knows what a callback or a payment is: callers hand over bytes
and get back what the broker said. ``payments/`` never imports this package.
"""
