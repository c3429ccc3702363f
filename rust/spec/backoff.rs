//! When a row proposes: after a proposal rejected outright the row waits a
//! cooldown that doubles on every such miss, up to `MAX_COOLDOWN` steps; any
//! accepted draft token resets it. Text with nothing to copy then costs almost
//! nothing, and a row that starts copying again soon proposes again.

/// Steps a row waits, at most, before proposing again after rejected drafts.
pub const MAX_COOLDOWN: u32 = 8;

/// One row's proposal history.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// Steps left before the row proposes again.
    wait: u32,
    /// The next wait after a miss.
    cooldown: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            wait: 0,
            cooldown: 1,
        }
    }
}

impl Backoff {
    /// Note the outcome of the row's last drafts (`accepted` of `drafted`; 0 of
    /// 0 when it had none) and say whether it proposes this step.
    pub fn may_propose(&mut self, drafted: usize, accepted: usize) -> bool {
        if drafted > 0 {
            if accepted > 0 {
                self.cooldown = 1;
            } else {
                self.wait = self.cooldown;
                self.cooldown = (self.cooldown * 2).min(MAX_COOLDOWN);
            }
        }
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        true
    }
}
