"""The RabbitMQ consumer: a thin pika shell around ``payments.callbacks.process_callback``."""
