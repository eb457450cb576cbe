//! Supervision of a process's long-running actors: the [`Supervision`] handle owns a
//! supervisor actor to which the orchestrator, the step pools, the pruner and the relay
//! are linked, so that none of them can die unnoticed.
//!
//! The rule it enforces: an actor that dies is either restarted by its own supervisor
//! (a step pool replaces a crashed worker; the orchestrator reports a crashed saga
//! driver to whoever waits on that saga), or its death reaches the code that runs the
//! process, which then stops with the cause instead of waiting on something that will
//! never answer. [`Supervision::died`] resolves with an [`ActorDied`] the first time a
//! linked actor fails (an `Err` from a handler, a panic) or is killed; an actor stopped
//! on purpose (`stop`, [`Supervision::stop`]) is not a death.
//!
//! ```no_run
//! # use sagabox::supervisor::Supervision;
//! # async fn run(work: impl std::future::Future<Output = ()>) -> Result<(), Box<dyn std::error::Error>> {
//! let supervision = Supervision::start().await?;
//! // spawn the process's actors with `supervision.spawn("pruner", Pruner::new(), args)`
//! tokio::select! {
//!     () = work => {}
//!     died = supervision.died() => return Err(died.into()),
//! }
//! supervision.stop().await;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::time::Duration;

use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr,
    SupervisionEvent,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The text of a panic's payload (`panic!` with a string or a format).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-text payload".to_owned())
}

/// A linked actor failed or was killed: what it was and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {actor} actor {cause}; the process cannot go on without it")]
pub struct ActorDied {
    /// The label it was spawned under ([`Supervision::spawn`]), or its actor id.
    pub actor: String,
    /// `failed: <its error or panic message>`, or `was killed`.
    pub cause: String,
}

/// Messages the supervisor actor handles.
#[derive(Debug)]
enum SupervisorMessage {
    /// Name a linked actor for reports.
    Label(ActorId, String),
    /// Stop every linked actor, the last spawned first, and answer when they are gone.
    Shutdown(RpcReplyPort<()>),
    /// Answer once every supervision event queued before it was handled.
    Sync(RpcReplyPort<()>),
}

/// The supervisor actor: linked actors' deaths go to its watch channel.
struct Supervisor;

struct SupervisorState {
    labels: HashMap<ActorId, String>,
    /// Linked actors in the order they were labelled, for an orderly shutdown.
    order: Vec<ActorId>,
    died: watch::Sender<Option<ActorDied>>,
    /// The first death's actor, while its label has not arrived yet (it died at once).
    unlabelled_death: Option<ActorId>,
    stopping: bool,
}

impl Actor for Supervisor {
    type Msg = SupervisorMessage;
    type State = SupervisorState;
    type Arguments = watch::Sender<Option<ActorDied>>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        died: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(SupervisorState {
            labels: HashMap::new(),
            order: Vec::new(),
            died,
            unlabelled_death: None,
            stopping: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMessage::Label(id, label) => {
                if state.unlabelled_death == Some(id) {
                    state.unlabelled_death = None;
                    state.died.send_modify(|first| {
                        if let Some(first) = first {
                            first.actor = label.clone();
                        }
                    });
                }
                state.order.push(id);
                state.labels.insert(id, label);
            }
            SupervisorMessage::Shutdown(reply) => {
                state.stopping = true;
                let children = myself.get_children();
                for id in state.order.iter().rev() {
                    if let Some(child) = children.iter().find(|child| child.get_id() == *id) {
                        // Bounded: one actor stuck in its work must not hold the process.
                        if child
                            .stop_and_wait(None, Some(STOP_CHILDREN_WITHIN))
                            .await
                            .is_err()
                        {
                            tracing::warn!(
                                actor =
                                    state.labels.get(id).map(String::as_str).unwrap_or_default(),
                                "a supervised actor did not stop in time; killed"
                            );
                            child.kill();
                        }
                    }
                }
                // Anything linked but never labelled goes too.
                myself
                    .stop_children_and_wait(None, Some(STOP_CHILDREN_WITHIN))
                    .await;
                let _ = reply.send(());
            }
            SupervisorMessage::Sync(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped without a `Shutdown` (its handle dropped on an error path): the linked
        // actors still get a graceful stop, bounded so that a stuck one cannot hold the
        // process.
        state.stopping = true;
        myself
            .stop_children_and_wait(None, Some(STOP_CHILDREN_WITHIN))
            .await;
        Ok(())
    }

    // Overridden: the default stops the supervisor when any child ends.
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, cause) = match event {
            SupervisionEvent::ActorFailed(cell, error) => (cell, format!("failed: {error}")),
            // A stop on purpose (`stop`, with or without a reason) is not a death; a kill
            // (`kill`, an abort signal) is.
            SupervisionEvent::ActorTerminated(cell, _, Some(reason)) if reason == KILLED => {
                (cell, "was killed".to_owned())
            }
            _ => return Ok(()),
        };
        if state.stopping {
            return Ok(());
        }
        let label = state.labels.get(&cell.get_id()).cloned();
        let actor = label.clone().unwrap_or_else(|| cell.get_id().to_string());
        tracing::error!(%actor, %cause, "a supervised actor died");
        let died = ActorDied { actor, cause };
        let first = state.died.send_if_modified(|first| {
            // The first death is the cause; later ones are usually its consequences.
            if first.is_none() {
                *first = Some(died);
                true
            } else {
                false
            }
        });
        if first && label.is_none() {
            // Died before its label arrived: the label names it when it does.
            state.unlabelled_death = Some(cell.get_id());
        };
        Ok(())
    }
}

/// The exit reason ractor gives an actor ended by a kill signal.
const KILLED: &str = "killed";

/// How long a supervisor dropped without [`Supervision::stop`] waits for its actors.
const STOP_CHILDREN_WITHIN: Duration = Duration::from_secs(10);

/// A running supervisor: link actors to it, learn when one dies, stop them all.
/// Dropping it stops the supervisor and, through it, every linked actor.
#[derive(Debug)]
pub struct Supervision {
    actor: ActorRef<SupervisorMessage>,
    handle: JoinHandle<()>,
    died: watch::Receiver<Option<ActorDied>>,
}

impl Supervision {
    /// Starts the supervisor actor.
    pub async fn start() -> Result<Self, SpawnErr> {
        let (died_tx, died) = watch::channel(None);
        let (actor, handle) = Actor::spawn(None, Supervisor, died_tx).await?;
        Ok(Self {
            actor,
            handle,
            died,
        })
    }

    /// The supervisor's cell, for an actor spawned with `Actor::spawn_linked` elsewhere;
    /// [`Supervision::label`] then names it in reports.
    pub fn cell(&self) -> ActorCell {
        self.actor.get_cell()
    }

    /// Names a linked actor in [`ActorDied`] reports and orders it for
    /// [`Supervision::stop`] (stopped in the reverse order of labelling).
    pub fn label(&self, actor: &ActorCell, label: &str) {
        let _ = self
            .actor
            .cast(SupervisorMessage::Label(actor.get_id(), label.to_owned()));
    }

    /// Spawns `actor` linked to the supervisor and labelled `label`.
    pub async fn spawn<A: Actor>(
        &self,
        label: &str,
        actor: A,
        arguments: A::Arguments,
    ) -> Result<(ActorRef<A::Msg>, JoinHandle<()>), SpawnErr> {
        let (spawned, handle) = Actor::spawn_linked(None, actor, arguments, self.cell()).await?;
        self.label(&spawned.get_cell(), label);
        Ok((spawned, handle))
    }

    /// The first linked actor that died, if one has, as far as the supervisor has been
    /// told (see [`Supervision::check_now`]).
    pub fn check(&self) -> Result<(), ActorDied> {
        match &*self.died.borrow() {
            Some(died) => Err(died.clone()),
            None => Ok(()),
        }
    }

    /// [`Supervision::check`], after the supervisor has handled every death already
    /// reported to it: an actor that died before this call is seen.
    pub async fn check_now(&self) -> Result<(), ActorDied> {
        let _ = ractor::call!(self.actor, SupervisorMessage::Sync);
        self.check()
    }

    /// Resolves when a linked actor fails or is killed, with the first such death; never
    /// resolves if none does.
    pub async fn died(&self) -> ActorDied {
        let mut died = self.died.clone();
        loop {
            if let Some(first) = &*died.borrow_and_update() {
                return first.clone();
            }
            if died.changed().await.is_err() {
                // The supervisor is gone, stopped on purpose: nothing more will die.
                return std::future::pending().await;
            }
        }
    }

    /// Stops every linked actor, the last labelled first (each after its work in
    /// flight, or killed if it has not stopped within 10 s), then the supervisor.
    /// Deaths during the stop are not reported.
    pub async fn stop(mut self) {
        let _ = ractor::call!(self.actor, SupervisorMessage::Shutdown);
        self.actor.stop(None);
        let _ = (&mut self.handle).await;
    }
}

impl Drop for Supervision {
    fn drop(&mut self) {
        self.actor.stop(None);
    }
}
