//! The embedded Lua scripts load on every master: `SCRIPT LOAD` of each
//! answers the SHA1 that seathold's `EVALSHA` will send.

use super::{list, Check, Nodes, Status};
use crate::scripts::Scripts;

pub(super) async fn check(nodes: &Nodes) -> Check {
    let scripts = Scripts::embedded();
    let mut failed = Vec::new();
    let mut masters = 0;
    for (addr, mut conn) in nodes.masters() {
        masters += 1;
        for script in scripts.all() {
            let want = redis::Script::new(script.body()).get_hash().to_owned();
            let reply: redis::RedisResult<String> = nodes
                .query(
                    &mut conn,
                    redis::cmd("SCRIPT").arg("LOAD").arg(script.body()),
                )
                .await;
            match reply {
                Ok(sha) if sha == want => {}
                Ok(sha) => failed.push(format!(
                    "{addr} {}.lua: SHA1 {sha}, not {want}",
                    script.name()
                )),
                Err(err) => failed.push(format!("{addr} {}.lua: {err}", script.name())),
            }
        }
    }
    let count = scripts.all().len();
    if failed.is_empty() {
        Check::pass(
            "scripts",
            format!("all {count} scripts of lua/ load on all {masters} masters"),
        )
    } else {
        Check::new(
            Status::Fail,
            "scripts",
            list(&failed),
            "seathold runs every operation as one of these scripts: allow SCRIPT LOAD, EVALSHA and EVAL, and check that Lua scripting is not disabled",
        )
    }
}
