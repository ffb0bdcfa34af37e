//! A foreign message — no event id, written by something that is not the outbox — put straight
//! on the broker with its own driver, the way another service sharing a stream, queue or topic
//! would. The consumers must record it and keep going.

use std::time::Duration;

use outbox::{Destination, Error, ErrorKind, Result};

use super::BrokerKind;

/// Write one foreign message to `destination` on the broker `url` names.
pub(crate) async fn foreign(kind: BrokerKind, url: &str, destination: &Destination) -> Result<()> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        Error::transient(ErrorKind::Connection, kind.name(), format!("writing the foreign message: {what}: {e}"))
    };
    let body: &[u8] = b"{\"hello\":\"from another service\"}";
    match kind {
        BrokerKind::Redis => {
            let config = outbox::redis::RedisConfig::from_url(url)?;
            let key = format!("{}{}", config.prefix, destination.as_str());
            let client = redis::Client::open(config.url.as_str()).map_err(|e| fail("client", &e))?;
            let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| fail("connect", &e))?;
            let _: String = redis::cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg("foreign")
                .arg(body)
                .query_async(&mut conn)
                .await
                .map_err(|e| fail("XADD", &e))?;
            Ok(())
        }
        BrokerKind::Amqp => {
            let config = outbox::amqp::AmqpConfig::from_url(url)?;
            let exchange = config.exchange_name(destination)?;
            let plain = url.split('?').next().unwrap_or(url);
            let conn = lapin::Connection::connect(plain, lapin::ConnectionProperties::default())
                .await
                .map_err(|e| fail("connect", &e))?;
            let result = async {
                let channel = conn.create_channel().await.map_err(|e| fail("channel", &e))?;
                channel
                    .confirm_select(lapin::options::ConfirmSelectOptions::default())
                    .await
                    .map_err(|e| fail("confirm_select", &e))?;
                // Persistent and mandatory, as a careful foreign producer would send it: it must
                // survive the broker restarts and reach the queues, or the write is retried.
                let confirm = channel
                    .basic_publish(
                        exchange.as_str().into(),
                        destination.as_str().into(),
                        lapin::options::BasicPublishOptions { mandatory: true, immediate: false },
                        body,
                        lapin::BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .map_err(|e| fail("publish", &e))?;
                match confirm.await.map_err(|e| fail("confirm", &e))? {
                    lapin::Confirmation::Ack(None) => Ok(()),
                    other => Err(fail("publish", &format!("not confirmed: {other:?}"))),
                }
            }
            .await;
            let _ = conn.close(200, "bye".into()).await;
            result
        }
        BrokerKind::Kafka => {
            use rdkafka::producer::{FutureProducer, FutureRecord};
            let bootstrap = url.trim_start_matches("kafka://").split('?').next().unwrap_or_default().to_string();
            let producer: FutureProducer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("message.timeout.ms", "10000")
                .create()
                .map_err(|e| fail("producer", &e))?;
            producer
                .send(FutureRecord::<str, [u8]>::to(destination.as_str()).payload(body), Duration::from_secs(10))
                .await
                .map_err(|(e, _)| fail("produce", &e))?;
            Ok(())
        }
    }
}
