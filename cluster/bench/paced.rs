//! paced: holds sent at a fixed rate (open loop), for the `latency` section
//! of `cluster/bench.sh`.
//!
//! wrk keeps every connection busy: it sends the next request the moment
//! the last answer arrives (a closed loop), so it measures how fast the
//! daemon can go, and at that speed its latency is the number of
//! connections divided by the throughput (Little's law), whatever the
//! daemon does. What an operator sizes for is the latency at the load the
//! daemon will carry. Here request i is due at `start + i / rate`, whether
//! or not earlier ones were answered; the first of the connections that is
//! free sends it when it is due (or as soon as one is free, when all are
//! busy). Each answer's latency is counted from when its request was due,
//! so a stall counts for every request it delayed, not only for the one it
//! caught (what wrk2 calls correcting for coordinated omission), and also
//! from when it was sent (what wrk counts).
//!
//! Build and run (the daemon first, e.g. `seathold dev`):
//!
//! ```text
//! cargo build --release --example paced
//! target/release/examples/paced --addr 127.0.0.1:8080 --rate 5000 --duration 10
//! ```
//!
//! It prints one line, `BENCH<TAB>key=value...`, with the keys of
//! `cluster/bench/common.lua` (`p50_us`, `p99_us` and `max_us` counted from
//! when each request was due) and these:
//! `offered_rps`, `p90_us`, `p999_us`, `send_p50_us`, `send_p99_us`,
//! `send_p999_us`, `send_max_us` (counted from the send), `late_1ms`
//! (requests sent more than 1 ms after they were due: every connection was
//! busy, or this process did not get a core in time), and `arrivals`.
//!
//! Seat ids never repeat within a run (`p<i>`, `p<i>-<k>` for the k-th seat
//! of request i), so every hold should be granted: shows are `<run>-<n>`
//! for a random n up to `--shows`, or the one show `<run>-hot` with
//! `--shows 0`, as in the wrk scripts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use rustix::time::Timespec;
use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex};

/// How the requests' due times are spaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Arrivals {
    /// Request i at `i / rate`: the same gap between every two.
    Even,
    /// Gaps drawn independently from an exponential distribution of mean
    /// `1 / rate` (a Poisson process): the arrivals of many independent
    /// clients, with their bursts.
    Poisson,
}

#[derive(Parser)]
#[command(about = "Holds at a fixed rate (open loop); prints one BENCH line")]
struct Args {
    /// The daemon's address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Requests per second, sent on schedule whatever the answers' latency.
    #[arg(long)]
    rate: f64,
    /// How the requests are spaced: `even` (every 1/rate) or `poisson`
    /// (random gaps of mean 1/rate).
    #[arg(long, value_enum, default_value_t = Arrivals::Even)]
    arrivals: Arrivals,
    /// Seed of the Poisson arrivals: the same seed gives the same schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds sent at the same rate first and not measured.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Connections (at most this many requests are in flight).
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Seats per hold: 1 sends POST /v1/shows/{show}/seats/{seat}/hold
    /// (no body), more send POST /v1/shows/{show}/holds {"seats":[...]}.
    #[arg(long, default_value_t = 1)]
    seats: usize,
    /// Shows to draw each request's show from at random; 0: one hot show.
    #[arg(long, default_value_t = 1_000_000)]
    shows: u64,
    /// Prefix of the show ids; use a new one for every run.
    #[arg(long, default_value = "paced")]
    run: String,
    /// The status that counts as success.
    #[arg(long, default_value_t = 201)]
    expect: u16,
    /// Seconds before a request without an answer counts as a timeout.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    /// Also write every measured request to this file, one line each:
    /// milliseconds from the start to when it was due, its latency from
    /// then and from its send (microseconds), and its status; in due order.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

/// One measured request: its status (0: no answer) and its latency in
/// microseconds from when it was due and from when it was sent.
struct Sample {
    due: Duration,
    status: u16,
    due_us: u32,
    send_us: u32,
}

/// What a connection saw.
#[derive(Default)]
struct Seen {
    samples: Vec<Sample>,
    socket_errors: u64,
    timeouts: u64,
    late: u64,
    first_bad: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    if !(args.rate > 0.0 && args.duration > 0.0 && args.warmup >= 0.0) {
        eprintln!("paced: --rate and --duration must be > 0, --warmup >= 0");
        std::process::exit(2);
    }
    if args.connections == 0 || args.seats == 0 {
        eprintln!("paced: --connections and --seats must be >= 1");
        std::process::exit(2);
    }
    let args = Arc::new(args);
    let mut seen = match run(args.clone()).await {
        Ok(seen) => seen,
        Err(e) => {
            eprintln!("paced: {e}");
            std::process::exit(1);
        }
    };
    if let Some(path) = &args.trace {
        seen.samples.sort_unstable_by_key(|s| s.due);
        let lines: String = seen
            .samples
            .iter()
            .map(|s| {
                format!(
                    "{:.3} {} {} {}\n",
                    s.due.as_secs_f64() * 1e3,
                    s.due_us,
                    s.send_us,
                    s.status
                )
            })
            .collect();
        if let Err(e) = std::fs::write(path, lines) {
            eprintln!("paced: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    println!("{}", report(&args, seen));
}

/// Connects, sends the whole schedule and gathers what every connection saw.
async fn run(args: Arc<Args>) -> std::io::Result<Seen> {
    // Connect first, so that the schedule does not start with handshakes.
    let mut senders = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let sender = connect(&args.addr).await.map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot connect to {}: {e}", args.addr))
        })?;
        senders.push(sender);
    }
    let schedule = Schedule::new(&args);
    let (due, slots) = mpsc::unbounded_channel();
    // tokio's timer has a 1 ms grain; a timerfd wakes this same thread
    // when each request is due, within microseconds. The connections take
    // the released requests in order.
    let releaser = tokio::spawn(schedule.clone().release(due));
    let slots = Arc::new(Mutex::new(slots));
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|sender| {
            tokio::spawn(connection(
                args.clone(),
                schedule.clone(),
                slots.clone(),
                sender,
            ))
        })
        .collect();
    let mut seen = Seen::default();
    for t in tasks {
        let s = t.await.expect("a connection task panicked");
        seen.samples.extend(s.samples);
        seen.socket_errors += s.socket_errors;
        seen.timeouts += s.timeouts;
        seen.late += s.late;
        if seen.first_bad.is_none() {
            seen.first_bad = s.first_bad;
        }
    }
    releaser
        .await
        .expect("the releasing task panicked")
        .map_err(|e| std::io::Error::new(e.kind(), format!("timerfd: {e}")))?;
    Ok(seen)
}

/// When each request is due, from the start: spaced as `--arrivals` says,
/// `1 / rate` apart on average, until the warm-up and the measured time
/// are over; those due before the warm-up's end are not measured.
#[derive(Clone)]
struct Schedule {
    start: Instant,
    offsets: Arc<[Duration]>,
    measured_from: Duration,
}

impl Schedule {
    fn new(args: &Args) -> Self {
        let offsets = offsets(
            args.arrivals,
            args.rate,
            args.warmup + args.duration,
            args.seed,
        );
        Self {
            start: Instant::now(),
            offsets: offsets.into(),
            measured_from: Duration::from_secs_f64(args.warmup),
        }
    }

    /// When request i is due (i is below the number of requests).
    fn due(&self, i: usize) -> Instant {
        self.start + self.offsets[i]
    }

    fn measured(&self, i: usize) -> bool {
        self.offsets[i] >= self.measured_from
    }

    /// Sends each request's number into `due` when it is due; returns (and
    /// so closes the channel) when the schedule ends.
    async fn release(self, due: mpsc::UnboundedSender<usize>) -> std::io::Result<()> {
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays
        // open for as long as it is registered.
        let timer = unsafe { AsyncFd::register_with_interest(timer, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut i = 0;
        loop {
            if i == self.offsets.len() {
                return Ok(());
            }
            let at = self.due(i);
            let now = Instant::now();
            if at > now {
                let wait = at - now;
                let value = Timespec {
                    tv_sec: wait.as_secs() as _,
                    tv_nsec: wait.subsec_nanos().into(),
                };
                let spec = Itimerspec {
                    it_interval: zero,
                    it_value: value,
                };
                timerfd_settime(timer.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
                loop {
                    let mut ready = timer.readable().await?;
                    match rustix::io::read(timer.get_ref(), &mut [0u8; 8]) {
                        Ok(_) => break,
                        Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            let now = Instant::now();
            while i < self.offsets.len() && self.due(i) <= now {
                if due.send(i).is_err() {
                    return Ok(());
                }
                i += 1;
            }
        }
    }
}

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(addr: &str) -> std::io::Result<Sender> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        // Ends when the connection closes; its errors reach send_request.
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends the requests that are due, one at a time, until the schedule ends.
async fn connection(
    args: Arc<Args>,
    schedule: Schedule,
    slots: Arc<Mutex<mpsc::UnboundedReceiver<usize>>>,
    mut sender: Sender,
) -> Seen {
    let mut seen = Seen::default();
    let limit = Duration::from_secs_f64(args.timeout);
    loop {
        let Some(i) = slots.lock().await.recv().await else {
            return seen;
        };
        let due = schedule.due(i);
        let measured = schedule.measured(i);
        let request = request(&args, i);
        let sent = Instant::now();
        if sent > due + Duration::from_millis(1) && measured {
            seen.late += 1;
        }
        let answer = tokio::time::timeout(limit, async {
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, body))
        })
        .await;
        let done = Instant::now();
        let status = match answer {
            Ok(Ok((status, body))) => {
                if status != args.expect && seen.first_bad.is_none() {
                    seen.first_bad =
                        Some(String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned());
                }
                status
            }
            failed => {
                if failed.is_err() {
                    seen.timeouts += 1;
                }
                seen.socket_errors += 1;
                // The connection is in an unknown state: start a new one.
                match connect(&args.addr).await {
                    Ok(s) => sender = s,
                    Err(_) => return seen,
                }
                0
            }
        };
        if measured {
            seen.samples.push(Sample {
                due: due - schedule.start,
                status,
                due_us: micros(done - due),
                send_us: micros(done - sent),
            });
        }
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Request i: a hold of fresh seats of a random show (or the hot show).
fn request(args: &Args, i: usize) -> Request<Full<Bytes>> {
    let show = if args.shows == 0 {
        format!("{}-hot", args.run)
    } else {
        format!("{}-{}", args.run, rand::random_range(1..=args.shows))
    };
    let builder = Request::builder()
        .method(Method::POST)
        .header("host", "seathold");
    let built = if args.seats == 1 {
        builder
            .uri(format!("/v1/shows/{show}/seats/p{i}/hold"))
            .body(Full::new(Bytes::new()))
    } else {
        let seats: Vec<String> = (1..=args.seats).map(|k| format!("\"p{i}-{k}\"")).collect();
        builder
            .uri(format!("/v1/shows/{show}/holds"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                "{{\"seats\":[{}]}}",
                seats.join(",")
            ))))
    };
    built.expect("a valid request")
}

/// The BENCH line: counts by status, and percentiles of both latencies.
fn report(args: &Args, seen: Seen) -> String {
    let mut statuses = std::collections::BTreeMap::new();
    for s in seen.samples.iter().filter(|s| s.status != 0) {
        *statuses.entry(s.status).or_insert(0u64) += 1;
    }
    let counted: u64 = statuses.values().sum();
    let ok = statuses.get(&args.expect).copied().unwrap_or(0);
    let mut due: Vec<u32> = seen.samples.iter().map(|s| s.due_us).collect();
    let mut send: Vec<u32> = seen.samples.iter().map(|s| s.send_us).collect();
    due.sort_unstable();
    send.sort_unstable();
    let mean = if due.is_empty() {
        0
    } else {
        due.iter().map(|&v| u64::from(v)).sum::<u64>() / due.len() as u64
    };
    let statuses = if statuses.is_empty() {
        "none".to_string()
    } else {
        statuses
            .iter()
            .map(|(s, n)| format!("{s}:{n}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let sample = seen
        .first_bad
        .unwrap_or_default()
        .replace(['\t', '\r', '\n'], " ");
    let fields = [
        format!("duration_us={:.0}", args.duration * 1e6),
        format!("requests={}", seen.samples.len()),
        format!("counted={counted}"),
        format!("ok={ok}"),
        format!("not_ok={}", counted - ok),
        format!("statuses={statuses}"),
        format!("socket_errors={}", seen.socket_errors),
        format!("timeouts={}", seen.timeouts),
        format!("p50_us={}", percentile(&due, 50.0)),
        format!("p90_us={}", percentile(&due, 90.0)),
        format!("p99_us={}", percentile(&due, 99.0)),
        format!("p999_us={}", percentile(&due, 99.9)),
        format!("max_us={}", due.last().copied().unwrap_or(0)),
        format!("mean_us={mean}"),
        format!("send_p50_us={}", percentile(&send, 50.0)),
        format!("send_p99_us={}", percentile(&send, 99.0)),
        format!("send_p999_us={}", percentile(&send, 99.9)),
        format!("send_max_us={}", send.last().copied().unwrap_or(0)),
        format!("late_1ms={}", seen.late),
        format!("offered_rps={:.0}", args.rate),
        format!(
            "arrivals={}",
            match args.arrivals {
                Arrivals::Even => "even",
                Arrivals::Poisson => "poisson",
            }
        ),
        format!("sample={sample}"),
    ];
    format!("BENCH\t{}", fields.join("\t"))
}

/// The due times of `seconds` of requests at `rate` per second, from the
/// start, in increasing order.
fn offsets(arrivals: Arrivals, rate: f64, seconds: f64, seed: u64) -> Vec<Duration> {
    let mut out = Vec::with_capacity((rate * seconds * 1.01) as usize + 16);
    match arrivals {
        Arrivals::Even => {
            for i in 0.. {
                let t = i as f64 / rate;
                if t >= seconds {
                    break;
                }
                out.push(Duration::from_secs_f64(t));
            }
        }
        Arrivals::Poisson => {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut t = 0.0;
            loop {
                // An exponential gap of mean 1 / rate; 1 - u is in (0, 1].
                t += -(1.0 - rng.random::<f64>()).ln() / rate;
                if t >= seconds {
                    break;
                }
                out.push(Duration::from_secs_f64(t));
            }
        }
    }
    out
}

/// The value below which `p` percent of the sorted values lie (nearest rank).
fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    // 99.9 is not exact in binary: 0.999 x 1000 comes out a hair above
    // 999, which would round up to the next rank.
    let rank = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Mutex as StdMutex;

    use http_body_util::Full;
    use hyper::server::conn::http1 as server;
    use hyper::service::service_fn;
    use hyper::{Response, StatusCode};
    use tokio::net::TcpListener;

    use super::*;

    /// A server that answers every request 201, except that a request
    /// arriving in `stall` is answered only when `stall` ends; it keeps
    /// every path it was sent.
    async fn server(stall: (Instant, Instant)) -> (String, Arc<StdMutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let paths = Arc::new(StdMutex::new(Vec::new()));
        let seen = paths.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let seen = seen.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            seen.lock().unwrap().push(request.uri().path().to_string());
                            let now = Instant::now();
                            if now >= stall.0 && now < stall.1 {
                                tokio::time::sleep_until(stall.1.into()).await;
                            }
                            let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                            *response.status_mut() = StatusCode::CREATED;
                            Ok::<_, hyper::Error>(response)
                        }
                    });
                    let _ = server::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (addr, paths)
    }

    fn args(addr: String) -> Args {
        Args {
            addr,
            rate: 1000.0,
            arrivals: Arrivals::Even,
            seed: 1,
            duration: 1.0,
            warmup: 0.2,
            connections: 4,
            seats: 1,
            shows: 1000,
            run: "t".into(),
            expect: 201,
            timeout: 5.0,
            trace: None,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u32> = (1..=1000).collect();
        assert_eq!(percentile(&v, 50.0), 500);
        assert_eq!(percentile(&v, 99.0), 990);
        assert_eq!(percentile(&v, 99.9), 999);
        assert_eq!(percentile(&v, 100.0), 1000);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 99.0), 0);
    }

    /// The point of an open loop: a stall of the server delays every
    /// request due while it lasts, and each of them counts it (from when it
    /// was due), not only the few requests that were in flight.
    #[tokio::test(flavor = "current_thread")]
    async fn a_stall_counts_for_every_request_it_delays() {
        let t0 = Instant::now();
        let stall = (
            t0 + Duration::from_millis(500),
            t0 + Duration::from_millis(700),
        );
        let (addr, paths) = server(stall).await;
        let args = Arc::new(args(addr));
        let seen = run(args.clone()).await.unwrap();

        // Every request of the measured second, each answered once, and
        // no seat sent twice (warm-up included).
        assert_eq!(seen.samples.len(), 1000);
        assert!(seen.samples.iter().all(|s| s.status == 201));
        assert_eq!(seen.socket_errors, 0);
        let paths = paths.lock().unwrap();
        assert_eq!(paths.len(), 1200);
        assert_eq!(paths.iter().collect::<HashSet<_>>().len(), 1200);
        assert!(
            paths[0].starts_with("/v1/shows/t-") && paths[0].ends_with("/hold"),
            "{}",
            paths[0]
        );

        // About 200 requests were due during the stall; the 4 connections
        // were stuck in it, so all of them waited, most over 50 ms.
        let waited = seen.samples.iter().filter(|s| s.due_us >= 50_000).count();
        let stuck = seen.samples.iter().filter(|s| s.send_us >= 50_000).count();
        assert!(
            (100..=260).contains(&waited),
            "{waited} requests waited >= 50 ms"
        );
        assert!(stuck <= 8, "{stuck} requests took >= 50 ms from their send");
        assert!(seen.late >= 100, "{} requests sent late", seen.late);
        let report = report(&args, seen);
        assert!(report.starts_with("BENCH\t"), "{report}");
        assert!(
            report.contains("\tok=1000\t") && report.contains("\tstatuses=201:1000\t"),
            "{report}"
        );
    }

    /// Even arrivals are 1/rate apart; Poisson ones are as many on average,
    /// with exponential gaps: their spread is their mean (coefficient of
    /// variation 1), bursts and lulls included, and a seed repeats them.
    #[test]
    fn arrivals_are_even_or_poisson() {
        let even = offsets(Arrivals::Even, 1000.0, 2.0, 1);
        assert_eq!(even.len(), 2000);
        assert_eq!(even[0], Duration::ZERO);
        assert_eq!(even[1999], Duration::from_secs_f64(1.999));

        let poisson = offsets(Arrivals::Poisson, 1000.0, 20.0, 7);
        assert_eq!(poisson, offsets(Arrivals::Poisson, 1000.0, 20.0, 7));
        assert_ne!(poisson, offsets(Arrivals::Poisson, 1000.0, 20.0, 8));
        // 20,000 expected; the count of a Poisson process has sd sqrt(n).
        assert!(
            (19_400..=20_600).contains(&poisson.len()),
            "{}",
            poisson.len()
        );
        assert!(poisson.windows(2).all(|w| w[0] <= w[1]));
        let gaps: Vec<f64> = poisson
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((0.97..=1.03).contains(&mean), "mean gap {mean} ms");
        assert!(
            (0.95..=1.05).contains(&(sd / mean)),
            "coefficient of variation {}",
            sd / mean
        );
        // Exponential gaps: P(gap > 3 x mean) = e^-3, about 5%.
        let long = gaps.iter().filter(|&&g| g > 3.0).count() as f64 / gaps.len() as f64;
        assert!(
            (0.04..=0.06).contains(&long),
            "{long} of the gaps over 3 ms"
        );
    }

    /// Four-seat holds go to /holds with four distinct seats in the body.
    #[test]
    fn several_seats_go_to_the_holds_route() {
        let mut a = args(String::new());
        a.seats = 4;
        a.shows = 0;
        let request = request(&a, 7);
        assert_eq!(request.uri().path(), "/v1/shows/t-hot/holds");
        assert_eq!(request.headers()["content-type"], "application/json");
    }
}
