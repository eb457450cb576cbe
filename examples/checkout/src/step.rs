//! [`CheckoutStep`]: the participant handler a consumer type names, for code that
//! starts the three participants in a loop over the saga's steps.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::Value;

use crate::{Email, Inventory, Payment, email, inventory, payment};

/// One of the three participants, chosen by consumer type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckoutStep {
    /// `payment`: charge and refund.
    Payment(Payment),
    /// `inventory`: decrement and restock.
    Inventory(Inventory),
    /// `email`: the confirmation.
    Email(Email),
}

impl CheckoutStep {
    /// The participant behind `consumer_type` (`payment`, `inventory` or `email`), or
    /// `None` for another name.
    pub fn of(consumer_type: &str) -> Option<Self> {
        match consumer_type {
            payment::CONSUMER => Some(Self::Payment(Payment)),
            inventory::CONSUMER => Some(Self::Inventory(Inventory)),
            email::CONSUMER => Some(Self::Email(Email)),
            _ => None,
        }
    }

    /// The consumer type this participant deduplicates as.
    pub fn consumer_type(&self) -> &'static str {
        match self {
            Self::Payment(_) => payment::CONSUMER,
            Self::Inventory(_) => inventory::CONSUMER,
            Self::Email(_) => email::CONSUMER,
        }
    }
}

impl<Db: sqlx::Database> StepHandler<Db> for CheckoutStep
where
    Payment: StepHandler<Db>,
    Inventory: StepHandler<Db>,
    Email: StepHandler<Db>,
{
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        match self {
            Self::Payment(handler) => handler.handle(conn, envelope).await,
            Self::Inventory(handler) => handler.handle(conn, envelope).await,
            Self::Email(handler) => handler.handle(conn, envelope).await,
        }
    }

    async fn handle_batch(
        &self,
        conn: &mut Db::Connection,
        envelopes: &[&Envelope],
    ) -> Option<Vec<Result<Value, StepError>>> {
        match self {
            Self::Payment(handler) => handler.handle_batch(conn, envelopes).await,
            Self::Inventory(handler) => handler.handle_batch(conn, envelopes).await,
            Self::Email(handler) => handler.handle_batch(conn, envelopes).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sagabox::saga::SagaDefinition;

    #[test]
    fn every_step_of_the_shipped_saga_has_its_participant() {
        let definition = SagaDefinition::from_toml_str(crate::CHECKOUT_TOML).unwrap();
        for step in definition.steps() {
            let participant = CheckoutStep::of(step.consumer_type().as_str())
                .unwrap_or_else(|| panic!("no participant for {}", step.consumer_type()));
            assert_eq!(participant.consumer_type(), step.consumer_type().as_str());
        }
        assert_eq!(CheckoutStep::of("orchestrator"), None);
    }
}
