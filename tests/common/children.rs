//! Child processes of a test, killed when the test ends however it ends (a panic
//! included), so a failed test leaves no `sagabox serve` running behind it.

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Processes killed (SIGKILL) and reaped on drop.
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Children {
    /// Takes the processes over.
    pub fn new(children: Vec<Child>) -> Self {
        Self(children)
    }
}

/// Sends SIGTERM to `child`: the graceful stop a service gets from its supervisor.
pub fn terminate(child: &Child) {
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -TERM {} failed", child.id());
}

/// Sends SIGTERM to `child` and waits for it to exit; panics, naming `what`, if it is
/// still running after `within`.
pub async fn stop(child: &mut Child, what: &str, within: Duration) -> ExitStatus {
    terminate(child);
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not stop within {within:?} of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl std::ops::Deref for Children {
    type Target = Vec<Child>;
    fn deref(&self) -> &Vec<Child> {
        &self.0
    }
}

impl std::ops::DerefMut for Children {
    fn deref_mut(&mut self) -> &mut Vec<Child> {
        &mut self.0
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
