//! Log lines and the program's final error share stderr. The exit-code contract promises that a
//! failed command's error is one line, last; but drivers log from threads of their own that
//! outlive the failure (lapin's I/O thread retries a refused login and reports giving up after
//! the command has already returned the refusal). The final error therefore closes the log:
//! log lines written after it are dropped, under the same lock that writes it, so none can
//! land after it.

use std::io::{self, Write};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A log that one final line closes.
struct Gate {
    /// Whether the final line has been written; held while any line is written.
    closed: Mutex<bool>,
}

impl Gate {
    const fn new() -> Self {
        Self { closed: Mutex::new(false) }
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        self.closed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Write `buf` to `sink` unless the gate is closed (then drop it).
    fn write(&self, sink: &mut dyn Write, buf: &[u8]) -> io::Result<()> {
        let closed = self.lock();
        if *closed {
            return Ok(());
        }
        sink.write_all(buf)
    }

    /// Close the gate and write `outbox: {text}` as one line, the sink's last.
    fn close(&self, sink: &mut dyn Write, text: &str) {
        let mut closed = self.lock();
        *closed = true;
        let _ = writeln!(sink, "outbox: {}", text.replace(['\n', '\r'], " "));
    }
}

static STDERR: Gate = Gate::new();

/// The log's writer: stderr until [`final_error`] closes it.
pub(crate) struct Log;

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        STDERR.write(&mut io::stderr().lock(), buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// Write `outbox: {text}` (one line, whatever `text` holds) as stderr's last line.
pub(crate) fn final_error(text: &str) {
    STDERR.close(&mut io::stderr().lock(), text);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A thread logging as fast as it can while the final error is written: whatever the
    /// interleaving, the error is the last line and the only `outbox:` line, and nothing is
    /// cut in half.
    #[test]
    fn the_final_error_is_the_last_line_whatever_logs_beside_it() {
        for round in 0..50 {
            let gate = Arc::new(Gate::new());
            let sink = Arc::new(Mutex::new(Vec::<u8>::new()));
            let logger = {
                let (gate, sink) = (gate.clone(), sink.clone());
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        let line = format!("ERROR lapin::io_loop: attempt {i}\n");
                        let mut sink = sink.lock().unwrap();
                        gate.write(&mut *sink, line.as_bytes()).unwrap();
                    }
                })
            };
            for _ in 0..round * 10 {
                std::thread::yield_now();
            }
            {
                let mut out = sink.lock().unwrap();
                gate.close(&mut *out, "amqp: the login was refused\n(ACCESS_REFUSED)");
            }
            logger.join().unwrap();
            let out = String::from_utf8(sink.lock().unwrap().clone()).unwrap();
            let lines: Vec<&str> = out.lines().collect();
            assert_eq!(
                lines.last(),
                Some(&"outbox: amqp: the login was refused (ACCESS_REFUSED)"),
                "round {round}: {} lines",
                lines.len()
            );
            assert_eq!(lines.iter().filter(|l| l.starts_with("outbox: ")).count(), 1, "round {round}");
            assert!(lines[..lines.len() - 1].iter().all(|l| l.starts_with("ERROR lapin::io_loop: attempt ")));
        }
    }
}
