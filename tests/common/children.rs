//! Child processes of a test, killed when the test ends however it ends (a panic
//! included), so a failed test leaves no `sagabox serve` running behind it.

use std::process::Child;

/// Processes killed (SIGKILL) and reaped on drop.
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Children {
    /// Takes the processes over.
    pub fn new(children: Vec<Child>) -> Self {
        Self(children)
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
