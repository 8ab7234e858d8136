//! What the command-line tools of the workspace share.

/// A reader that goes away (`hkv-sim … | head -3`) ends the process
/// quietly with status 141 (128 + SIGPIPE, what a shell reports for other
/// tools killed by it), instead of the panic of `println!` on a closed
/// pipe. Call it first in `main`. (hkvctl, which does not link this
/// crate, keeps the same few lines.)
pub fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.contains("Broken pipe")) {
            std::process::exit(141);
        }
        default(info)
    }));
}
