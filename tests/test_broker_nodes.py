"""Several RabbitMQ nodes in AMQP_URL: every client connects to a live one and moves on when it loses it.

Against the real test broker: a second "node" is a TCP relay of this test's
own in front of it, which the test cuts (as a SIGKILLed node drops its
connections), and a dead node is a port nobody listens on. A nack is made by
the broker itself: a policy caps the test queue at one message and refuses
publishes beyond it (``overflow: reject-publish``), as a quorum queue without
a leader refuses them during an election.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import pika
import pytest

from broker.connection import Nodes, connect, node_urls, unreachable
from broker.consume import Action, ConsumeLoop
from broker.events import EventsPublisher
from broker.publisher import CallbackPublisher
from payments.errors import ConfigError
from payments.infra.settings import load_settings
from tests import vhosts


def dead_port() -> int:
    """A port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_port(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port``."""
    scheme, rest = url.split("://", 1)
    creds, _, hostpath = rest.rpartition("@")
    _, _, path = hostpath.partition("/")
    return f"{scheme}://{creds + '@' if creds else ''}127.0.0.1:{port}/{path}"


class Relay:
    """A TCP relay to the real broker: a node of its own port that ``cut`` kills, connections and all."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Stop listening and drop every connection, as a killed node does."""
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def message_count(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return conn.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        conn.close()


def broker_port(url: str) -> int:
    return pika.URLParameters(url).port


def starting_at(nodes: Nodes, index: int) -> Nodes:
    nodes._index = index  # the test decides which node is tried first (each process starts at a random one)
    return nodes


# --- settings --------------------------------------------------------------------------------------------


def test_a_comma_list_of_nodes_is_accepted_and_each_node_is_kept():
    settings = load_settings({"PAYSYNC_ENV": "development", "AMQP_URL": " amqp://a:b@h1:5672/v , amqp://a:b@h2/v "})
    assert node_urls(settings.amqp_url) == ["amqp://a:b@h1:5672/v", "amqp://a:b@h2/v"]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("amqp://h1/v,http://h2/v", "AMQP_URL (node 2 of 2) must start with"),
        ("amqp://h1/v,amqp://h2:notaport/v", "AMQP_URL (node 2 of 2) is not a valid URL"),
        ("amqp://h1/v,amqp:///v", "AMQP_URL (node 2 of 2) names no host"),
        ("amqp://h1:5672/a/b", "AMQP_URL: the vhost must be one path segment"),
    ],
)
def test_every_node_of_the_list_is_checked_at_start(raw, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_settings({"PAYSYNC_ENV": "development", "AMQP_URL": raw})


# --- connecting ------------------------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_connect_skips_a_dead_node_and_the_probe_says_which_nodes_are_down(amqp_url):
    dead = with_port(amqp_url, dead_port())
    both = f"{dead},{amqp_url}"
    nodes = starting_at(Nodes(both), 0)
    connect(both, 1.0, nodes).close()
    assert nodes.current() == amqp_url
    assert unreachable(both, 1.0) is None
    why = unreachable(f"{dead},{with_port(amqp_url, dead_port())}", 1.0)
    assert why is not None and why.count("127.0.0.1:") == 2 and "guest" not in why


@pytest.mark.rabbitmq
def test_the_publisher_moves_to_the_next_node_when_its_node_is_lost_and_every_callback_is_confirmed(
    amqp_url, amqp_queue
):
    relay = Relay(broker_port(amqp_url))
    publisher = CallbackPublisher(f"{with_port(amqp_url, relay.port)},{amqp_url}", amqp_queue)
    starting_at(publisher._nodes, 0)
    try:
        for log_id in range(1, 11):
            assert publisher.publish(log_id, json.dumps({"log_id": log_id}).encode())
        assert publisher.flush(10)
        assert publisher.stats.node == f"127.0.0.1:{relay.port}" and relay.accepted == 1
        relay.cut()
        deadline = time.monotonic() + 10
        while publisher.state == "connected" and time.monotonic() < deadline:
            time.sleep(0.05)  # the heartbeat-free way to notice: the socket closes
        for log_id in range(11, 21):
            assert publisher.publish(log_id, json.dumps({"log_id": log_id}).encode())
        assert publisher.flush(10)
    finally:
        publisher.close()
    assert publisher.stats.node == f"127.0.0.1:{broker_port(amqp_url)}"
    assert (publisher.stats.confirmed, publisher.stats.failed, publisher.stats.dropped) == (20, 0, 0)
    assert message_count(amqp_url, amqp_queue) == 20


@pytest.mark.rabbitmq
def test_the_consumer_and_the_events_publisher_reach_the_live_node_past_a_dead_one(amqp_url, amqp_queue):
    dead = with_port(amqp_url, dead_port())
    both = f"{dead},{amqp_url}"
    publisher = CallbackPublisher(amqp_url, amqp_queue)
    try:
        for log_id in (1, 2, 3):
            publisher.publish(log_id, b'{"x": 1}')
        assert publisher.flush(10)
    finally:
        publisher.close()
    seen: list[bytes] = []

    def handler(body: bytes) -> Action:
        seen.append(body)
        if len(seen) == 3:
            loop.stop()
        return Action.ACK

    loop = ConsumeLoop(both, amqp_queue, handler, prefetch=10, timeout=1.0)
    starting_at(loop.nodes, 0)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(20)
    assert not runner.is_alive() and loop.acked == 3

    exchange = f"{amqp_queue}.events"
    events = EventsPublisher(both, exchange, connect_timeout=2.0)
    starting_at(events._nodes, 0)
    try:
        events.publish("PaymentSucceeded", b"{}", message_id="m1", message_type="PaymentSucceeded", timestamp=1)
    finally:
        events.close()
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        conn.channel().exchange_delete(exchange)
        conn.close()


# --- nacks -----------------------------------------------------------------------------------------------


@pytest.fixture
def one_message_queue(amqp_url, amqp_queue):
    """A policy on the test's vhost: the test queue holds one message and the broker nacks any more."""
    ctl = vhosts.shutil.which("rabbitmqctl")
    if not ctl or vhosts._host(amqp_url) not in vhosts._LOCAL_HOSTS:
        pytest.skip("needs rabbitmqctl on the broker's machine to set a queue policy")
    vhost = vhosts._split(amqp_url)[2]
    name = f"nack-{amqp_queue}"
    definition = json.dumps({"max-length": 1, "overflow": "reject-publish"})
    subprocess.run(
        [ctl, "-q", "set_policy", "-p", vhost, "--apply-to", "queues", name, f"^{amqp_queue}$", definition],
        check=True,
        capture_output=True,
        timeout=60,
    )
    yield amqp_queue
    subprocess.run([ctl, "-q", "clear_policy", "-p", vhost, name], capture_output=True, timeout=60, check=False)


def take_one(url: str, queue: str) -> bool:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        method, _, _ = conn.channel().basic_get(queue, auto_ack=True)
        return method is not None
    finally:
        conn.close()


@pytest.mark.rabbitmq
def test_a_nacked_callback_is_published_again_until_the_broker_takes_it(amqp_url, one_message_queue):
    publisher = CallbackPublisher(amqp_url, one_message_queue, retry_seconds=10.0)
    try:
        assert publisher.publish(1, b"first") and publisher.flush(10)
        publisher.publish(2, b"second")  # the queue is full: nacked, and published again after a pause
        time.sleep(0.8)
        assert publisher.stats.retried >= 1 and publisher.stats.failed == 0
        assert take_one(amqp_url, one_message_queue)  # room again (a leader elected): the next attempt lands
        assert publisher.flush(10)
    finally:
        publisher.close()
    assert (publisher.stats.confirmed, publisher.stats.failed) == (2, 0)


@pytest.mark.rabbitmq
def test_a_callback_nacked_past_its_retry_time_is_left_to_the_sweep(amqp_url, one_message_queue):
    failures: list[tuple[str, int]] = []
    publisher = CallbackPublisher(
        amqp_url, one_message_queue, retry_seconds=1.0, on_failure=lambda why, n: failures.append((why, n))
    )
    try:
        assert publisher.publish(1, b"first") and publisher.flush(10)
        started = time.monotonic()
        publisher.publish(2, b"second")
        assert publisher.flush(10)
        took = time.monotonic() - started
    finally:
        publisher.close()
    assert 1.0 <= took < 4.0, took
    assert (publisher.stats.confirmed, publisher.stats.failed) == (1, 1)
    assert failures == [("nack", 1)]
