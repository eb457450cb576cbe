//! [`Link`]: a RabbitMQ connection that sends with publisher confirms, the broker's
//! side of [`Sender`](crate::transport::Sender).

use lapin::Connection;

use crate::envelope::{ConsumerType, Envelope};
use crate::publish::{Confirmed, Publish};

use super::broker::{Publisher, Routing, connect, declare, delete_queue};
use super::{AmqpConfig, AmqpError, codec};

/// A connection and its confirming channel, with the settings queues are declared by.
#[derive(Debug)]
pub(crate) struct Link {
    config: AmqpConfig,
    connection: Connection,
    publisher: Publisher,
}

impl Link {
    /// Connects to `config`'s broker as `<prefix>/<role>` and opens a confirming channel.
    pub(crate) async fn connect(config: &AmqpConfig, role: &str) -> Result<Self, AmqpError> {
        let connection = connect(config, role).await?;
        let publisher = Publisher::open(&connection).await?;
        Ok(Self {
            config: config.clone(),
            connection,
            publisher,
        })
    }
}

impl Publish for Link {
    type Error = AmqpError;

    fn is_connected(&self) -> bool {
        self.connection.status().connected()
    }

    async fn declare(&self, destination: &ConsumerType) -> Result<(), AmqpError> {
        declare(&self.connection, &self.config, destination)
            .await
            .map(drop)
    }

    async fn send_all(
        &self,
        messages: &[(&ConsumerType, &Envelope)],
    ) -> Result<Confirmed<AmqpError>, AmqpError> {
        // Published in order on one channel (the broker keeps that order per queue),
        // then every confirm awaited.
        let mut confirms = Vec::with_capacity(messages.len());
        for (destination, envelope) in messages {
            let (body, properties) = codec::encode(envelope);
            let queue = self.config.queue(destination);
            let confirm = self
                .publisher
                .start_publish(&queue, &body, properties, Routing::Required)
                .await?;
            confirms.push((queue, confirm));
        }
        let mut count = 0;
        let mut failure = None;
        for (queue, confirm) in confirms {
            match Publisher::confirmed(&queue, confirm).await {
                Ok(()) if failure.is_none() => count += 1,
                Ok(()) => {}
                Err(error) => {
                    failure.get_or_insert(error);
                }
            }
        }
        Ok(Confirmed { count, failure })
    }

    async fn remove(&self, consumer_type: &ConsumerType) -> Result<(), AmqpError> {
        for queue in [
            self.config.queue(consumer_type),
            self.config.dead_queue(consumer_type),
        ] {
            delete_queue(&self.connection, &queue).await?;
        }
        Ok(())
    }

    async fn close(self) {
        let _ = self.connection.close(200, "sender closing".into()).await;
    }
}
