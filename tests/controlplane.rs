//! The controller against the real control plane (kube-apiserver,
//! kube-controller-manager and kube-scheduler v1.32.13 with default flags)
//! and the node simulator. SKIPPED with the reason when the binaries are not
//! on this machine.
use std::time::{Duration, Instant};

use lastgasp_tests::{controlplane, nodesim};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_simulated_nodes_run_a_stateful_pod() {
    let Some(cp) = controlplane::shared("the_simulated_nodes_run_a_stateful_pod") else {
        return;
    };
    rt().block_on(async {
        let c = cp.admin();
        let sim = nodesim::Sim::start(c.clone()).await.unwrap();
        for n in ["sim-a", "sim-b", "sim-c"] {
            sim.add_node(n).await.unwrap();
        }
        nodesim::namespace(&c, "smoke").await.unwrap();
        nodesim::stateful_app(&c, "smoke", "web", "sim-a")
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(n) = nodesim::running_on(&c, "smoke", "web").await.unwrap() {
                assert_eq!(n, "sim-a");
                assert!(nodesim::attached_to(&c, "smoke", "web", "sim-a")
                    .await
                    .unwrap());
                println!("web-0 Running on {n} after {:?}", t0.elapsed());
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "web-0 not Running within 60 s;\nkcm: {}\nscheduler: {}",
                cp.log_tail("kube-controller-manager", 20),
                cp.log_tail("kube-scheduler", 20)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}
