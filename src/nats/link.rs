//! [`Link`]: a NATS connection that sends to JetStream, each message stored before the
//! next is sent, the broker's side of [`Sender`](crate::transport::Sender).

use async_nats::Client;
use async_nats::jetstream::Context;

use crate::envelope::{ConsumerType, Envelope};
use crate::publish::{Confirmed, Publish};

use super::jetstream::{connect, declare, delete_stream, publish};
use super::{NatsConfig, NatsError, codec};

/// A client and its JetStream context, with the settings streams are declared by.
#[derive(Debug)]
pub(crate) struct Link {
    config: NatsConfig,
    client: Client,
    context: Context,
}

impl Link {
    /// Connects to `config`'s server as `<prefix>/<role>`.
    pub(crate) async fn connect(config: &NatsConfig, role: &str) -> Result<Self, NatsError> {
        let client = connect(config, role).await?;
        let context = async_nats::jetstream::new(client.clone());
        Ok(Self {
            config: config.clone(),
            client,
            context,
        })
    }
}

impl Publish for Link {
    type Error = NatsError;

    /// The client reconnects by itself; a send while it is away fails.
    fn is_connected(&self) -> bool {
        true
    }

    async fn declare(&self, destination: &ConsumerType) -> Result<(), NatsError> {
        declare(&self.context, &self.config, destination)
            .await
            .map(drop)
    }

    async fn send_all(
        &self,
        messages: &[(&ConsumerType, &Envelope)],
    ) -> Result<Confirmed<NatsError>, NatsError> {
        // One at a time: JetStream stores each before the next is sent, so a failure
        // leaves only what follows it unsent, in order. Each goes under its message id
        // as `Nats-Msg-Id`: the server's duplicate window drops a second send of it.
        let mut count = 0;
        for (destination, envelope) in messages {
            let (body, headers) = codec::encode(envelope);
            let subject = self.config.subject(destination);
            if let Err(error) = publish(&self.context, &subject, headers, body).await {
                return Ok(Confirmed {
                    count,
                    failure: Some(error),
                });
            }
            count += 1;
        }
        Ok(Confirmed {
            count,
            failure: None,
        })
    }

    async fn remove(&self, consumer_type: &ConsumerType) -> Result<(), NatsError> {
        for stream in [
            self.config.stream(consumer_type),
            self.config.dead_stream(consumer_type),
        ] {
            delete_stream(&self.context, &stream).await?;
        }
        Ok(())
    }

    async fn close(self) {
        let _ = self.client.drain().await;
    }
}
