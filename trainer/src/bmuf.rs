//! Block-wise model-update filtering: BMUF (K. Chen and Q. Huo, "Scalable training of deep
//! learning machines by incremental block training with intra-block parallel optimization and
//! blockwise model-update filtering", ICASSP 2016) and BMUF-Adam (K. Chen, H. Ding and Q. Huo,
//! "Parallelizing Adam optimizer with blockwise model-update filtering", ICASSP 2020).
//!
//! Instead of averaging gradients every step, each of the N ranks runs `tau` steps of its local
//! optimiser on its own data (intra-block parallel optimisation), starting from the same model
//! W_g(n-1). Then the models are averaged with one all-reduce and filtered:
//!
//! ```text
//!   G(n)     = avg_i W_i(n) - W_g(n-1)           block-level "gradient"
//!   Delta(n) = eta * Delta(n-1) + zeta * G(n)    block momentum eta, block learning rate zeta
//! ```
//!
//! With eta = 1 - 1/N and zeta = 1 (the paper's recommendation, `eta=auto` here), a constant G
//! gives Delta -> N G: averaging N models shrinks the step by about N and the filter restores it.
//!
//! **Where the next block starts.** The paper tracks the filtered model W(n) = W(n-1) + Delta(n)
//! and starts the next block from it (classical block momentum) or from the Nesterov look-ahead
//! W_g(n) = W(n) + eta Delta(n). `form=paper` (the default) is that. The implementations of
//! fairseq (`fairseq/optim/bmuf.py`, `_block_sync`), CNTK (`BlockMomentumSGD`) and pika (the
//! BMUF-Adam article's reference code, `tencent-ailab/pika`, `trainer/bmuf.py`) store the
//! look-ahead as the next start and add the next Delta to it, so the look-ahead is never taken
//! back: W_g(n) - W_g(n-1) = (1 + eta) Delta(n) instead of the paper's (1 + eta) Delta(n) -
//! eta Delta(n-1). With eta = 1 - 1/N that moves the model by up to 2 - 1/N times the paper's
//! step (`form=kept` reproduces it). Both forms keep W_g only: the paper's W(n-1) is recovered as
//! W_g(n-1) - eta Delta(n-1). Like fairseq, the all-reduce carries the models' differences from
//! W_g(n-1) (small numbers, so f32 averaging loses less) and zeta applies to the *average*
//! (CNTK and pika sum, or scale by (1 - eta), instead: their block_lr = N is zeta = 1 here).
//!
//! **The local optimiser's momentum.** pika re-creates its local SGD optimiser after every
//! synchronisation, so each block's local momentum starts from zero; fairseq keeps each rank's
//! momentum buffer across blocks. Kept, the buffer still holds the velocity of the rank's
//! previous block, which block momentum has already applied to every rank through Delta, so the
//! same history moves the model twice (measured: 7 points lost at N = 4, tau = 8; the trainer's
//! README has the runs). `local=reset` (the default) zeroes it at every block, as pika does.
//!
//! **BMUF-Adam.** With Adam as the local optimiser, the moment buffers m and v travel in the same
//! all-reduce as the model (3x the parameter bytes). Averaging them naively gives buffers that
//! describe tau steps of one worker, while the model moved by (1 + eta) Delta, the equivalent of
//! tau + eta rho_n steps. Chen, Ding and Huo correct this (reference implementation:
//! `tencent-ailab/pika`, `trainer/bmuf.py`, `BmufAdamTrainer.update_and_sync`):
//!
//! ```text
//!   rho_n      = eta * rho_{n-1} + tau                       mini-batches equivalent to Delta(n)
//!   m_init(n+1) = [b1^tau (b1^(eta rho_n) - 1) m_init(n) + (1 - b1^tau b1^(eta rho_n)) avg m(n)]
//!                 / (1 - b1^tau)                              and likewise v with b2
//!   t          += eta * rho_n                                 Adam's step counter, every rank
//! ```
//!
//! with m_init(1) = v_init(1) = 0 and rho_0 = 0. Writing g^ = (avg m - b1^tau m_init) /
//! (1 - b1^tau) for the block's effective gradient average, this is m_init(n+1) =
//! b1^(tau + eta rho_n) m_init(n) + (1 - b1^(tau + eta rho_n)) g^: what Adam would hold after
//! tau + eta rho_n steps of g^. The reference applies it with the Nesterov look-ahead; it is
//! applied unchanged with classical block momentum.
//!
//! **BMUF-Adam's first moment.** The corrected m_init(n+1) is close to g^ itself (at N = 8,
//! tau + eta rho_n tends to 64 steps, and b1^64 ~ 0.001), so the next block's first local steps
//! move along the last block's average direction again, from a start that block momentum has
//! already moved along it: the double count of a kept SGD momentum, smaller (m is an average,
//! not a sum) but amplified by the block momentum's ~N. `first=reset` zeroes m at every block
//! and restarts its bias correction (Adam's own first steps: m^ = g at the block's first step),
//! while v and the step counter keep the correction. Measured (the trainer's README): it trains
//! faster in every run; at the end, N = 8, the article's form is 1.04 points below synchronous
//! Adam and `first=reset` 0.80 (3 seeds; the final gain is within their noise).

use toroid::{Communicator, ReduceOp};

use crate::bail;
use crate::error::Result;

/// How BMUF-Adam sets the moment buffers of the next block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moments {
    /// The average of the ranks' m and v (the baseline Chen, Ding and Huo improve on).
    Naive,
    /// Chen, Ding and Huo's correction (see the module documentation).
    Corrected,
}

/// Where the Nesterov look-ahead goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The paper's: the filtered model W(n) = W(n-1) + Delta(n) is tracked apart from the
    /// next block's start W_g(n) = W(n) + eta Delta(n), so each look-ahead is taken back at the
    /// next block and W_g(n) - W_g(n-1) = (1 + eta) Delta(n) - eta Delta(n-1).
    Paper,
    /// fairseq's, CNTK's and pika's: the look-ahead stays in the stored start,
    /// W_g(n) - W_g(n-1) = (1 + eta) Delta(n).
    Kept,
}

/// What happens to the local optimiser's SGD momentum at a block boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalMomentum {
    /// It carries on from the rank's own last block (fairseq's default).
    Keep,
    /// It starts every block from zero (pika re-creates its SGD optimiser after every sync).
    Reset,
}

/// BMUF-Adam's first moment m at a block boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstMoment {
    /// Set by `moments` (corrected or naive), as the article does (`first=moments`).
    Moments,
    /// Zeroed, with its bias correction counted from the block's first step (the second
    /// moment stays as `moments` sets it): the Adam form of `local=reset`. The default.
    Reset,
}

/// A parsed `--bmuf` value, before the world size is known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BmufSpec {
    /// Local steps per block.
    pub tau: u64,
    /// Block momentum; None: 1 - 1/N.
    pub eta: Option<f64>,
    /// Block learning rate.
    pub zeta: f64,
    /// Nesterov block momentum.
    pub nesterov: bool,
    /// BMUF-Adam's moment handling.
    pub moments: Moments,
    /// Where the Nesterov look-ahead goes.
    pub form: Form,
    /// The local SGD momentum at block boundaries.
    pub local: LocalMomentum,
    /// BMUF-Adam's first moment at block boundaries.
    pub first: FirstMoment,
}

impl BmufSpec {
    /// The defaults (tau, which has none, is 0 here).
    pub const DEFAULTS: BmufSpec = BmufSpec {
        tau: 0,
        eta: None,
        zeta: 1.0,
        nesterov: true,
        moments: Moments::Corrected,
        form: Form::Paper,
        local: LocalMomentum::Reset,
        first: FirstMoment::Reset,
    };

    /// Parses `tau=T,eta=auto|x,zeta=x,nesterov=bool,moments=corrected|naive,form=paper|kept,
    /// local=reset|keep,first=reset|moments`. `tau` is required; the defaults are the BMUF papers'
    /// settings: eta=auto (1 - 1/N), zeta=1, Nesterov block momentum in the paper's form, the
    /// local SGD momentum reset at every block (as the BMUF-Adam article's code does),
    /// moments=corrected; and BMUF-Adam's first moment reset at every block (first=reset, ours:
    /// see the module documentation).
    pub fn parse(s: &str) -> Result<BmufSpec> {
        let mut spec = BmufSpec { tau: 0, ..BmufSpec::DEFAULTS };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else { bail!("--bmuf: '{part}' is not KEY=VALUE") };
            let (k, v) = (k.trim(), v.trim());
            let num = |v: &str| -> Result<f64> {
                match v.parse::<f64>() {
                    Ok(x) if x.is_finite() => Ok(x),
                    _ => bail!("--bmuf: {k}={v} is not a number"),
                }
            };
            match k {
                "tau" => match v.parse::<u64>() {
                    Ok(t) if t >= 1 => spec.tau = t,
                    _ => bail!("--bmuf: tau={v} must be a whole number >= 1"),
                },
                "eta" if v == "auto" => spec.eta = None,
                "eta" => match num(v)? {
                    e if (0.0..1.0).contains(&e) => spec.eta = Some(e),
                    _ => bail!("--bmuf: eta={v} must be in [0, 1)"),
                },
                "zeta" => spec.zeta = num(v)?,
                "nesterov" => match v {
                    "true" | "1" | "yes" => spec.nesterov = true,
                    "false" | "0" | "no" => spec.nesterov = false,
                    _ => bail!("--bmuf: nesterov={v} must be true or false"),
                },
                "moments" => match v {
                    "corrected" => spec.moments = Moments::Corrected,
                    "naive" => spec.moments = Moments::Naive,
                    _ => bail!("--bmuf: moments={v} must be corrected or naive"),
                },
                "form" => match v {
                    "paper" => spec.form = Form::Paper,
                    "kept" => spec.form = Form::Kept,
                    _ => bail!("--bmuf: form={v} must be paper or kept"),
                },
                "local" => match v {
                    "keep" => spec.local = LocalMomentum::Keep,
                    "reset" => spec.local = LocalMomentum::Reset,
                    _ => bail!("--bmuf: local={v} must be keep or reset"),
                },
                "first" => match v {
                    "moments" => spec.first = FirstMoment::Moments,
                    "reset" => spec.first = FirstMoment::Reset,
                    _ => bail!("--bmuf: first={v} must be moments or reset"),
                },
                _ => {
                    bail!("--bmuf: unknown key '{k}' (tau, eta, zeta, nesterov, moments, form, local, first)")
                }
            }
        }
        if spec.tau == 0 {
            bail!("--bmuf needs tau=T (local steps per block), e.g. --bmuf tau=8");
        }
        Ok(spec)
    }

    /// The settings for a job of `world` ranks: eta = 1 - 1/N unless given.
    pub fn resolve(&self, world: usize) -> BmufConfig {
        let eta = self.eta.unwrap_or(1.0 - 1.0 / world.max(1) as f64);
        BmufConfig {
            tau: self.tau,
            eta,
            zeta: self.zeta,
            nesterov: self.nesterov,
            moments: self.moments,
            form: self.form,
            local: self.local,
            first: self.first,
        }
    }
}

/// BMUF settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BmufConfig {
    /// Local steps per block.
    pub tau: u64,
    /// Block momentum.
    pub eta: f64,
    /// Block learning rate.
    pub zeta: f64,
    /// Nesterov block momentum.
    pub nesterov: bool,
    /// BMUF-Adam's moment handling.
    pub moments: Moments,
    /// Where the Nesterov look-ahead goes.
    pub form: Form,
    /// The local SGD momentum at block boundaries.
    pub local: LocalMomentum,
    /// BMUF-Adam's first moment at block boundaries.
    pub first: FirstMoment,
}

/// The block update (the form in `cfg.form`). `g` is G(n) = avg W_i(n) - W_g(n-1); `start`
/// (W_g) and `delta` (Delta) are updated in place and `params` receives the next block's start.
pub fn block_update(cfg: &BmufConfig, start: &mut [f32], delta: &mut [f32], g: &[f32], params: &mut [f32]) {
    let (eta, zeta) = (cfg.eta, cfg.zeta);
    for i in 0..start.len() {
        let old = delta[i] as f64;
        let d = eta * old + zeta * g[i] as f64;
        let mut w = start[i] as f64 + d;
        if cfg.nesterov {
            w += eta * d;
            if cfg.form == Form::Paper {
                // W(n-1) = W_g(n-1) - eta Delta(n-1): the last look-ahead is taken back.
                w -= eta * old;
            }
        }
        delta[i] = d as f32;
        start[i] = w as f32;
        params[i] = start[i];
    }
}

/// Chen, Ding and Huo's moment buffer for the next block: replaces `init` (m_init(n), or v_init)
/// by m_init(n+1) from the rank average `avg` of the buffer after `tau` local steps, with decay
/// `beta`, block momentum `eta` and `rho` = rho_n.
pub fn corrected_moment(beta: f64, tau: f64, eta: f64, rho: f64, init: &mut [f32], avg: &[f32]) {
    let bt = beta.powf(tau);
    let br = beta.powf(eta * rho);
    let denom = 1.0 - bt;
    let (a, b) = (bt * (br - 1.0) / denom, (1.0 - bt * br) / denom);
    for (x, &m) in init.iter_mut().zip(avg) {
        *x = (a * *x as f64 + b * m as f64) as f32;
    }
}

/// The local Adam state that BMUF-Adam synchronises.
#[derive(Debug)]
pub struct AdamState<'a> {
    /// First moments, flat in parameter order.
    pub m: &'a mut [f32],
    /// Second moments.
    pub v: &'a mut [f32],
    /// Adam's step counter (the second moment's bias correction).
    pub t: &'a mut f64,
    /// The first moment's step counter (equal to `t` unless `first=reset`).
    pub t1: &'a mut f64,
    /// Adam's beta1.
    pub beta1: f64,
    /// Adam's beta2.
    pub beta2: f64,
}

/// One rank's BMUF state.
#[derive(Debug)]
pub struct Bmuf {
    /// Settings.
    pub cfg: BmufConfig,
    /// W_g: the model every rank started this block from.
    start: Vec<f32>,
    /// Delta: the filtered block update.
    delta: Vec<f32>,
    /// rho_n: mini-batches equivalent to Delta(n).
    rho: f64,
    /// BMUF-Adam's m_init(n), v_init(n) (empty until the first Adam block).
    m_init: Vec<f32>,
    v_init: Vec<f32>,
    /// Local steps since the last synchronisation.
    steps_in_block: u64,
    /// Blocks synchronised so far.
    pub blocks: u64,
}

impl Bmuf {
    /// Starts from `params` (identical on every rank), with Delta = 0 and rho = 0.
    pub fn new(cfg: BmufConfig, params: Vec<f32>) -> Bmuf {
        let n = params.len();
        Bmuf {
            cfg,
            start: params,
            delta: vec![0.0; n],
            rho: 0.0,
            m_init: vec![],
            v_init: vec![],
            steps_in_block: 0,
            blocks: 0,
        }
    }

    /// Counts one local step; true when the block is complete (time to [`Bmuf::sync`]).
    pub fn local_step(&mut self) -> bool {
        self.steps_in_block += 1;
        self.steps_in_block >= self.cfg.tau
    }

    /// True when local steps were taken since the last synchronisation.
    pub fn pending(&self) -> bool {
        self.steps_in_block > 0
    }

    /// rho_n after the last block.
    pub fn rho(&self) -> f64 {
        self.rho
    }

    /// Ends the block: one all-reduce (average) of this rank's `params` minus the block start
    /// (and of Adam's m and v when `adam` is given), then the block update, which writes the
    /// next block's start into `params` (identical on every rank), and for Adam the next
    /// block's moments and step counter. A block cut short (at an epoch end) counts the local
    /// steps it had as its tau. Returns the payload bytes this rank all-reduced.
    pub fn sync(
        &mut self,
        comm: Option<&Communicator>,
        params: &mut [f32],
        adam: Option<AdamState>,
    ) -> Result<usize> {
        let n = params.len();
        if n != self.start.len() {
            bail!("BMUF: {n} parameters, but the block started with {}", self.start.len());
        }
        let tau = self.steps_in_block as f64;
        let mut msg = Vec::with_capacity(if adam.is_some() { 3 * n } else { n });
        msg.extend(params.iter().zip(&self.start).map(|(w, s)| w - s));
        if let Some(a) = &adam {
            msg.extend_from_slice(a.m);
            msg.extend_from_slice(a.v);
        }
        let bytes = match comm {
            Some(c) => {
                c.all_reduce(&mut msg, ReduceOp::Avg)?;
                msg.len() * 4
            }
            None => 0,
        };
        let (g, moments) = msg.split_at(n);
        self.rho = self.cfg.eta * self.rho + tau;
        block_update(&self.cfg, &mut self.start, &mut self.delta, g, params);
        if let Some(a) = adam {
            let (m_avg, v_avg) = moments.split_at(n);
            match self.cfg.moments {
                Moments::Naive => {
                    a.m.copy_from_slice(m_avg);
                    a.v.copy_from_slice(v_avg);
                }
                Moments::Corrected => {
                    if self.m_init.len() != n {
                        self.m_init = vec![0.0; n];
                        self.v_init = vec![0.0; n];
                    }
                    let (eta, rho) = (self.cfg.eta, self.rho);
                    corrected_moment(a.beta1, tau, eta, rho, &mut self.m_init, m_avg);
                    corrected_moment(a.beta2, tau, eta, rho, &mut self.v_init, v_avg);
                    a.m.copy_from_slice(&self.m_init);
                    a.v.copy_from_slice(&self.v_init);
                    *a.t += eta * rho;
                }
            }
            *a.t1 = *a.t;
            if self.cfg.first == FirstMoment::Reset {
                a.m.fill(0.0);
                *a.t1 = 0.0;
            }
        }
        self.steps_in_block = 0;
        self.blocks += 1;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::AdamConfig;
    use crate::test_ranks::on_ranks;

    fn cfg(eta: f64, zeta: f64, nesterov: bool) -> BmufConfig {
        BmufConfig {
            tau: 2,
            eta,
            zeta,
            nesterov,
            moments: Moments::Corrected,
            form: Form::Kept,
            local: LocalMomentum::Keep,
            first: FirstMoment::Moments,
        }
    }

    #[test]
    fn parse_and_resolve() {
        let s = BmufSpec::parse("tau=8").unwrap();
        assert_eq!(s, BmufSpec { tau: 8, ..BmufSpec::DEFAULTS });
        // The defaults are the papers' settings.
        assert!(s.nesterov && s.form == Form::Paper && s.local == LocalMomentum::Reset && s.zeta == 1.0);
        assert!((s.resolve(4).eta - 0.75).abs() < 1e-15);
        assert_eq!(s.resolve(1).eta, 0.0);
        let s = BmufSpec::parse("tau=4, eta=0.5,zeta=1.2,nesterov=false,moments=naive").unwrap();
        assert_eq!(
            s,
            BmufSpec {
                tau: 4,
                eta: Some(0.5),
                zeta: 1.2,
                nesterov: false,
                moments: Moments::Naive,
                ..BmufSpec::DEFAULTS
            }
        );
        assert_eq!(s.resolve(8).eta, 0.5);
        let s = BmufSpec::parse("tau=8,nesterov=true,form=paper,local=reset").unwrap();
        assert_eq!((s.nesterov, s.form, s.local), (true, Form::Paper, LocalMomentum::Reset));
        assert_eq!((s.resolve(4).form, s.resolve(4).local), (Form::Paper, LocalMomentum::Reset));
        assert_eq!(s.first, FirstMoment::Reset);
        assert_eq!(BmufSpec::parse("tau=8,first=moments").unwrap().resolve(8).first, FirstMoment::Moments);
        for bad in [
            "",
            "eta=0.5",
            "tau=0",
            "tau=x",
            "tau=2,eta=1",
            "tau=2,zeta=nan",
            "tau=2,nesterov=maybe",
            "tau=2,k=1",
            "tau=2,form=fairseq",
            "tau=2,local=zero",
            "tau=2,first=zero",
            "tau",
        ] {
            assert!(BmufSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn block_update_matches_hand_computation() {
        // Start [1, 2], Delta(n-1) = [0.1, -0.2], G = [0.3, 0.4], eta 0.5, zeta 1:
        // Delta = [0.05 + 0.3, -0.1 + 0.4] = [0.35, 0.3]; classical: W_g = [1.35, 2.3];
        // Nesterov: W_g = [1.35 + 0.175, 2.3 + 0.15] = [1.525, 2.45].
        for (nesterov, want) in [(false, [1.35, 2.3]), (true, [1.525, 2.45])] {
            let (mut start, mut delta, mut p) = (vec![1.0f32, 2.0], vec![0.1f32, -0.2], vec![0.0f32; 2]);
            block_update(&cfg(0.5, 1.0, nesterov), &mut start, &mut delta, &[0.3, 0.4], &mut p);
            assert!((delta[0] - 0.35).abs() < 1e-6 && (delta[1] - 0.3).abs() < 1e-6, "{delta:?}");
            for i in 0..2 {
                assert!((p[i] - want[i]).abs() < 1e-6 && start[i] == p[i], "{p:?} vs {want:?}");
            }
        }
        // The paper's form takes the last look-ahead back: W(n-1) = 1 - 0.5 * 0.1 = 0.95, so
        // W_g = 0.95 + 0.35 + 0.175 = 1.475 (and 2.1 + 0.3 + 0.15 = 2.55); classical is unchanged.
        for (nesterov, want) in [(false, [1.35, 2.3]), (true, [1.475, 2.55])] {
            let (mut start, mut delta, mut p) = (vec![1.0f32, 2.0], vec![0.1f32, -0.2], vec![0.0f32; 2]);
            let c = BmufConfig { form: Form::Paper, ..cfg(0.5, 1.0, nesterov) };
            block_update(&c, &mut start, &mut delta, &[0.3, 0.4], &mut p);
            for i in 0..2 {
                assert!((p[i] - want[i]).abs() < 1e-6 && start[i] == p[i], "{p:?} vs {want:?}");
            }
        }
        // zeta scales G: zeta 2, eta 0 gives W_g = start + 2 G.
        let (mut start, mut delta, mut p) = (vec![1.0f32], vec![5.0f32], vec![0.0f32]);
        block_update(&cfg(0.0, 2.0, true), &mut start, &mut delta, &[0.25], &mut p);
        assert!((p[0] - 1.5).abs() < 1e-6 && (delta[0] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn corrected_moments_match_hand_computation() {
        // beta 0.9, tau 2, eta 0.5, rho_1 = 2 (so eta rho = 1), m_init = 0.5, avg m = 1:
        // [0.81 (0.9 - 1) 0.5 + (1 - 0.81 * 0.9) 1] / (1 - 0.81) = 0.2305 / 0.19.
        let mut init = vec![0.5f32];
        corrected_moment(0.9, 2.0, 0.5, 2.0, &mut init, &[1.0]);
        assert!((init[0] as f64 - 0.2305 / 0.19).abs() < 1e-6, "{init:?}");
        // The equivalent form: Adam after tau + eta rho = 3 steps of g^ = (1 - 0.81 * 0.5) / 0.19.
        let g = (1.0 - 0.81 * 0.5) / 0.19;
        assert!((init[0] as f64 - (0.729 * 0.5 + 0.271 * g)).abs() < 1e-6);
        // eta = 0 (one rank): the buffer is the plain average, as if nothing was corrected.
        let mut init = vec![0.3f32];
        corrected_moment(0.999, 4.0, 0.0, 4.0, &mut init, &[0.7]);
        assert!((init[0] - 0.7).abs() < 1e-6);
    }

    /// One BMUF-Adam block on a single rank (no communicator), checked against the formulas.
    #[test]
    fn adam_sync_advances_the_counter_and_sets_moments() {
        let c = BmufConfig { tau: 2, eta: 0.5, zeta: 1.0, nesterov: true, ..cfg(0.0, 1.0, true) };
        let mut b = Bmuf::new(c, vec![1.0]);
        assert!(!b.local_step() && b.local_step());
        let (mut p, mut m, mut v, mut t, mut t1) = (vec![0.8f32], vec![0.4f32], vec![0.02f32], 2.0, 2.0);
        let a = AdamState { m: &mut m, v: &mut v, t: &mut t, t1: &mut t1, beta1: 0.9, beta2: 0.99 };
        assert_eq!(b.sync(None, &mut p, Some(a)).unwrap(), 0);
        assert_eq!(t1, t);
        // rho_1 = 2; G = -0.2; Delta = -0.2; W_g = 1 - 0.2 - 0.1 = 0.7; t = 2 + 0.5 * 2 = 3.
        assert!((p[0] - 0.7).abs() < 1e-6 && b.rho() == 2.0 && t == 3.0, "{p:?} {t}");
        // m_init(2) = (1 - 0.9^2 * 0.9) / (1 - 0.81) * 0.4; v likewise with 0.99.
        assert!((m[0] as f64 - 0.271 / 0.19 * 0.4).abs() < 1e-6, "{m:?}");
        let want_v = (1.0 - 0.99f64.powi(3)) / (1.0 - 0.99f64.powi(2)) * 0.02;
        assert!((v[0] as f64 - want_v).abs() < 1e-7, "{v:?}");
        // Naive: plain averages, counter untouched.
        let mut b = Bmuf::new(BmufConfig { moments: Moments::Naive, ..c }, vec![1.0]);
        b.local_step();
        let (mut p, mut m, mut v, mut t, mut t1) = (vec![0.8f32], vec![0.4f32], vec![0.02f32], 2.0, 2.0);
        let a = AdamState { m: &mut m, v: &mut v, t: &mut t, t1: &mut t1, beta1: 0.9, beta2: 0.99 };
        b.sync(None, &mut p, Some(a)).unwrap();
        assert_eq!((m[0], v[0], t, t1), (0.4, 0.02, 2.0, 2.0));
        // first=reset: m zeroed and its counter restarted; v and t as `moments` says.
        let mut b = Bmuf::new(BmufConfig { first: FirstMoment::Reset, ..c }, vec![1.0]);
        b.local_step();
        let (mut p, mut m, mut v, mut t, mut t1) = (vec![0.8f32], vec![0.4f32], vec![0.02f32], 2.0, 2.0);
        let a = AdamState { m: &mut m, v: &mut v, t: &mut t, t1: &mut t1, beta1: 0.9, beta2: 0.99 };
        b.sync(None, &mut p, Some(a)).unwrap();
        let want_v = (1.0 - 0.99f64.powf(1.5)) / (1.0 - 0.99f64.powi(1)) * 0.02;
        assert_eq!((m[0], t1), (0.0, 0.0));
        assert!(t == 2.5 && (v[0] as f64 - want_v).abs() < 1e-7, "{v:?} {t}");
    }

    /// tau = 1, eta = 0, zeta = 1 is synchronous model averaging: after every step each rank
    /// holds the mean of the ranks' locally updated models. With plain SGD (no momentum) that is
    /// also synchronous gradient averaging: mean(w - lr g_i) = w - lr mean(g_i).
    #[test]
    fn tau_1_eta_0_zeta_1_is_model_averaging_and_ranks_agree() {
        let n = 3;
        let grad =
            |r: usize, step: usize, i: usize| ((r * 7 + step * 3 + i) % 5) as f32 - 2.0 + 0.1 * r as f32;
        let lr = 0.1f32;
        let out = on_ranks(n, move |r, comm| {
            let c = BmufConfig { tau: 1, eta: 0.0, zeta: 1.0, nesterov: true, ..cfg(0.0, 1.0, true) };
            let mut w = vec![1.0f32, -0.5, 2.0, 0.25];
            let mut b = Bmuf::new(c, w.clone());
            let mut history = vec![];
            for step in 0..4 {
                for (i, x) in w.iter_mut().enumerate() {
                    *x -= lr * grad(r, step, i);
                }
                assert!(b.local_step());
                assert_eq!(b.sync(Some(&comm), &mut w, None).unwrap(), 16);
                history.push(w.clone());
            }
            history
        });
        // Every rank holds the same bits after every block ...
        for h in &out[1..] {
            assert_eq!(h, &out[0]);
        }
        // ... equal to the average of the local models, i.e. SGD on the averaged gradient.
        let mut w = [1.0f64, -0.5, 2.0, 0.25];
        for (step, got) in out[0].iter().enumerate() {
            for (i, x) in w.iter_mut().enumerate() {
                let g: f64 = (0..n).map(|r| grad(r, step, i) as f64).sum::<f64>() / n as f64;
                *x -= lr as f64 * g;
                assert!((got[i] as f64 - *x).abs() < 1e-5, "step {step}: {got:?} vs {w:?}");
            }
        }
    }

    /// BMUF-Adam on 2 ranks with different data: the ranks agree on model, moments and step
    /// counter after each block, and the values follow the formulas.
    #[test]
    fn bmuf_adam_ranks_agree_after_every_block() {
        let out = on_ranks(2, |r, comm| {
            let c = BmufConfig { tau: 3, eta: 0.5, zeta: 1.0, nesterov: true, ..cfg(0.0, 1.0, true) };
            let adam = AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
            let mut w = vec![0.5f32, -1.0];
            let (mut m, mut v, mut t, mut t1) = (vec![0.0f32; 2], vec![0.0f32; 2], 0.0f64, 0.0f64);
            let mut b = Bmuf::new(c, w.clone());
            let mut history = vec![];
            for step in 0..6 {
                let g: Vec<f32> =
                    w.iter().map(|x| x - if r == 0 { 1.0 } else { -1.0 } + 0.01 * step as f32).collect();
                t += 1.0;
                t1 += 1.0;
                adam.update(0.01, t1, t, &mut w, &g, &mut m, &mut v, true);
                if b.local_step() {
                    let a =
                        AdamState { m: &mut m, v: &mut v, t: &mut t, t1: &mut t1, beta1: 0.9, beta2: 0.999 };
                    assert_eq!(b.sync(Some(&comm), &mut w, Some(a)).unwrap(), 24);
                    history.push((w.clone(), m.clone(), v.clone(), t));
                }
            }
            history
        });
        assert_eq!(out[0], out[1]);
        // rho_1 = 3, t = 3 + 1.5; rho_2 = 1.5 + 3, t = 4.5 + 3 + 2.25.
        assert_eq!(out[0][0].3, 4.5);
        assert_eq!(out[0][1].3, 9.75);
    }
}
