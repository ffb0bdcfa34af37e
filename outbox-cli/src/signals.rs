//! The stop policy shared by the long-running commands (`outbox relay`, `outbox chaos`): the
//! first SIGTERM or SIGINT asks for a clean stop, a second one exits at once, for an operator who
//! will not wait for a stop stuck on a dead server.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Call `first` with the first SIGTERM/SIGINT's name; on a second one call `second`, then exit
/// at once with status 130. A signal whose handler cannot be installed is not listened for
/// (`unavailable` is told which); with neither, the future ends without calling anything.
///
/// The handlers are installed when this is called, not when the future is first polled: a
/// command that announces it is running after this call never dies of a signal's default action
/// in between (a SIGTERM right after `relay started` ended `outbox relay` at once, status 143,
/// while its listener was still a spawned task not yet run).
pub(crate) fn first_then_exit(
    first: impl FnOnce(&'static str),
    second: impl FnOnce(&'static str),
    unavailable: impl Fn(&'static str, std::io::Error),
) -> impl std::future::Future<Output = ()> {
    let listen = |kind, name| signal(kind).map_err(|e| unavailable(name, e)).ok();
    let (mut term, mut int) = (listen(SignalKind::terminate(), "SIGTERM"), listen(SignalKind::interrupt(), "SIGINT"));
    async move {
        if term.is_none() && int.is_none() {
            return;
        }
        first(next(&mut term, &mut int).await);
        second(next(&mut term, &mut int).await);
        std::process::exit(130);
    }
}

/// The next of the signals listened for, by name.
async fn next(term: &mut Option<Signal>, int: &mut Option<Signal>) -> &'static str {
    async fn recv(s: &mut Option<Signal>) {
        match s {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    tokio::select! {
        () = recv(term) => "SIGTERM",
        () = recv(int) => "SIGINT",
    }
}
