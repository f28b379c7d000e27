"""The RabbitMQ consumer: a thin pika shell around ``payments.inbound.callbacks.process_callback``."""
