//! The servers of one combination and the fault proxy in front of each, and the URLs the
//! relays, consumers and producers use — always the proxy's address, never the server's.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use outbox::{ConsumerGroup, Destination, Error, ErrorKind, Result};

use super::proxy::FaultProxy;
use super::schedule::ProxyTarget;
use super::servers::{self, Server};
use super::{BrokerKind, Combo, StoreKind};

/// Servers, proxies and URLs of one combination run. Dropping it stops the runner-owned servers.
pub(crate) struct Env {
    /// The store, through its proxy (SQLite: the file).
    pub(crate) store_url: String,
    /// The broker, through its proxy, for relays, producers and the audit group.
    pub(crate) broker_url: String,
    /// The broker URL the consumer processes use (short reclaim / session timeouts, so that a
    /// killed consumer's deliveries come back within the run).
    pub(crate) consumer_broker_url: String,
    kind: BrokerKind,
    /// On Kafka, the clients that read partitions and committed offsets for the runner (built
    /// once, without contacting the broker; each read opens its own group-less consumer).
    kafka: Option<outbox::kafka::KafkaBroker>,
    broker: Box<dyn Server>,
    pg: Option<Box<dyn Server>>,
    broker_proxy: FaultProxy,
    pg_proxy: Option<FaultProxy>,
    /// One restart of the broker at a time.
    pub(crate) broker_lock: tokio::sync::Mutex<()>,
    /// One restart of PostgreSQL at a time.
    pub(crate) pg_lock: tokio::sync::Mutex<()>,
    declared: Mutex<Option<(Destination, Vec<ConsumerGroup>)>>,
    /// Last: released after the servers above are stopped.
    _live: super::Live,
}

fn server_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::permanent(ErrorKind::Config, "chaos", format!("{what}: {e}"))
}

impl Env {
    /// Whether the servers `combo` needs can run here: `Err` names what is missing and the
    /// script that installs it.
    pub(crate) fn available(combo: Combo) -> std::result::Result<(), String> {
        if combo.has_pg() {
            servers::PgNode::bin_dir()?;
        }
        match combo.broker {
            BrokerKind::Redis => on_path("redis-server", &[]).map(|_| ()).ok_or_else(|| {
                "`redis-server` not found on PATH; install it with `scripts/services ensure redis`".to_string()
            }),
            BrokerKind::Kafka => servers::TansuNode::binary().map(|_| ()),
            BrokerKind::Amqp => {
                on_path("rabbitmqctl", &["/usr/sbin", "/usr/lib/rabbitmq/bin"]).ok_or_else(|| {
                    "`rabbitmqctl` not found; install RabbitMQ with `scripts/services ensure rabbitmq`".to_string()
                })?;
                std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], 5672).into(), Duration::from_secs(2))
                    .map(|_| ())
                    .map_err(|e| {
                        format!("nothing answers AMQP on 127.0.0.1:5672 ({e}); start it with `scripts/services ensure rabbitmq`")
                    })
            }
        }
    }

    /// Start the servers and their proxies.
    pub(crate) async fn start(combo: Combo, dir: &Path) -> Result<Self> {
        let (pg, pg_proxy, store_url) = match combo.store {
            StoreKind::Postgres => {
                let node = servers::PgNode::start().await.map_err(|e| server_error("postgres", e))?;
                let proxy =
                    FaultProxy::start("postgres", node.addr()).await.map_err(|e| server_error("postgres proxy", e))?;
                let url = node.url_at(proxy.addr());
                (Some(Box::new(node) as Box<dyn Server>), Some(proxy), url)
            }
            StoreKind::Sqlite => (None, None, format!("sqlite://{}", dir.join("chaos.db").display())),
        };
        let (broker, broker_proxy): (Box<dyn Server>, FaultProxy) = match combo.broker {
            BrokerKind::Redis => {
                let node = servers::RedisNode::start().await.map_err(|e| server_error("redis", e))?;
                let proxy =
                    FaultProxy::start("redis", node.addr()).await.map_err(|e| server_error("redis proxy", e))?;
                (Box::new(node), proxy)
            }
            BrokerKind::Amqp => {
                let node = servers::RabbitNode::connect().await.map_err(|e| server_error("rabbitmq", e))?;
                let proxy =
                    FaultProxy::start("rabbitmq", node.addr()).await.map_err(|e| server_error("rabbitmq proxy", e))?;
                (Box::new(node), proxy)
            }
            BrokerKind::Kafka => {
                // tansu advertises the proxy's address, so clients stay behind the proxy after
                // bootstrap: the proxy comes first and is pointed at tansu once it listens.
                let placeholder: std::net::SocketAddr = ([127, 0, 0, 1], 9).into();
                let proxy =
                    FaultProxy::start("kafka", placeholder).await.map_err(|e| server_error("kafka proxy", e))?;
                let node =
                    servers::TansuNode::start_behind(&proxy).await.map_err(|e| server_error("kafka (tansu)", e))?;
                (Box::new(node), proxy)
            }
        };
        let base = broker.url_at(broker_proxy.addr());
        let (broker_url, consumer_broker_url) = match combo.broker {
            BrokerKind::Redis => (base.clone(), format!("{base}?outbox_claim_idle_ms=2000")),
            BrokerKind::Amqp => (base.clone(), base),
            BrokerKind::Kafka => (
                format!("{base}?outbox_partitions=4"),
                // tansu keeps a group's rebalance timeout (librdkafka's `max.poll.interval.ms`,
                // 300 s by default) and, after a restart, waits that long for a member that was
                // SIGKILLed before a new one gets partitions; 20 s keeps recovery inside the drain.
                format!("{base}?outbox_partitions=4&outbox_session_timeout_ms=6000&max.poll.interval.ms=20000"),
            ),
        };
        let kafka = match combo.broker {
            BrokerKind::Kafka => {
                Some(outbox::kafka::KafkaBroker::new(outbox::kafka::KafkaConfig::from_url(&broker_url)?)?)
            }
            BrokerKind::Redis | BrokerKind::Amqp => None,
        };
        Ok(Self {
            store_url,
            broker_url,
            consumer_broker_url,
            kind: combo.broker,
            kafka,
            broker,
            pg,
            broker_proxy,
            pg_proxy,
            broker_lock: tokio::sync::Mutex::new(()),
            pg_lock: tokio::sync::Mutex::new(()),
            declared: Mutex::new(None),
            _live: super::Live::new(),
        })
    }

    /// Restart the broker; its name and downtime.
    pub(crate) async fn restart_broker(&self) -> Result<(String, Duration)> {
        let down =
            self.broker.restart().await.map_err(|e| server_error(&format!("restarting {}", self.broker.name()), e))?;
        Ok((self.broker.name().to_string(), down))
    }

    /// On Kafka, each partition of the run's destination with its log end and the run's chaos
    /// group's committed offset; `None` on other brokers, before the destination is declared,
    /// or when the broker does not answer within `patience`.
    pub(crate) async fn kafka_positions(&self, patience: Duration) -> Option<Vec<outbox::kafka::GroupPosition>> {
        let kafka = self.kafka.as_ref()?;
        let (destination, group) = {
            let declared = self.declared.lock().unwrap_or_else(|p| p.into_inner());
            let (destination, groups) = declared.as_ref()?;
            (destination.clone(), groups.first()?.clone())
        };
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let read = kafka.group_positions(&destination, &group);
            if let Ok(Ok(positions)) = tokio::time::timeout_at(deadline, read).await {
                return Some(positions);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// The runner's Kafka inspector (see the field), `None` on other brokers.
    pub(crate) fn kafka(&self) -> Option<&outbox::kafka::KafkaBroker> {
        self.kafka.as_ref()
    }

    /// The broker's own failure since its last start, if its log shows one (see
    /// [`Server::failed_internally`](super::servers::Server::failed_internally)).
    pub(crate) fn broker_failed_internally(&self) -> Option<String> {
        self.broker.failed_internally()
    }

    /// The broker's log file, where the runner started the broker and it logs what a stalled
    /// group needs (see [`Server::log_file`](super::servers::Server::log_file)).
    pub(crate) fn broker_log(&self) -> Option<std::path::PathBuf> {
        self.broker.log_file()
    }

    /// Restart PostgreSQL; its name and downtime.
    pub(crate) async fn restart_pg(&self) -> Result<(String, Duration)> {
        let pg = self.pg.as_ref().ok_or_else(|| Error::invalid_input("chaos", "this combination has no PostgreSQL"))?;
        let down = pg.restart().await.map_err(|e| server_error("restarting postgres", e))?;
        Ok((pg.name().to_string(), down))
    }

    /// The proxy a proxy fault hits (PostgreSQL's only where there is one).
    pub(crate) fn proxy(&self, target: ProxyTarget) -> Option<&FaultProxy> {
        match target {
            ProxyTarget::Broker => Some(&self.broker_proxy),
            ProxyTarget::Postgres => self.pg_proxy.as_ref().or(Some(&self.broker_proxy)),
        }
    }

    /// Remember what the run declared, to delete it from a shared server at the end.
    pub(crate) fn register_destination(&self, destination: &Destination, groups: &[ConsumerGroup]) {
        *self.declared.lock().unwrap_or_else(|p| p.into_inner()) = Some((destination.clone(), groups.to_vec()));
    }

    /// Remove what the run created on a server it does not own (RabbitMQ's exchange and
    /// queues); runner-owned servers go away with their directories.
    pub(crate) async fn cleanup(&self) {
        let declared = self.declared.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let (BrokerKind::Amqp, Some((destination, groups))) = (self.kind, declared) {
            let deleted = async {
                let amqp = outbox::amqp::AmqpBroker::new(outbox::amqp::AmqpConfig::from_url(&self.broker_url)?);
                amqp.connect().await?;
                let r = amqp.delete(&destination, &groups).await;
                amqp.close().await;
                r
            };
            if let Err(e) = tokio::time::timeout(Duration::from_secs(30), deleted)
                .await
                .unwrap_or_else(|_| Err(Error::transient(ErrorKind::Timeout, "chaos", "timed out")))
            {
                eprintln!("outbox chaos: could not delete the run's RabbitMQ exchange and queues: {e}");
            }
        }
    }
}

/// `name` on `PATH` or in one of `extra`.
fn on_path(name: &str, extra: &[&str]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra.iter().map(std::path::PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
