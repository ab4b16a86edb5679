//! SelfSubjectAccessReview: allowed unless a deny rule matches; rules set
//! from the handle or the control call; the review is not stored.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use serde_json::json;

use lastgasp_apidouble::{AccessRule, ApiDouble, Fault};

fn review(verb: &str, group: &str, resource: &str, sub: &str, ns: &str) -> SelfSubjectAccessReview {
    SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource: (!sub.is_empty()).then(|| sub.into()),
                namespace: (!ns.is_empty()).then(|| ns.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn allowed(api: &Api<SelfSubjectAccessReview>, r: SelfSubjectAccessReview) -> (bool, String) {
    let out = api.create(&PostParams::default(), &r).await.unwrap();
    let st = out.status.unwrap();
    (st.allowed, st.reason.unwrap_or_default())
}

#[tokio::test]
async fn reviews_follow_the_deny_list() {
    let d = ApiDouble::start().await.unwrap();
    let client = d.client_without_retry().await;
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());

    assert_eq!(
        allowed(&api, review("create", "", "pods", "eviction", "")).await,
        (true, String::new())
    );

    d.deny_access(AccessRule::deny("create", "", "pods").subresource("eviction"));
    let (ok, reason) = allowed(&api, review("create", "", "pods", "eviction", "")).await;
    assert!(!ok);
    assert!(reason.contains("create pods/eviction"), "{reason}");
    // Narrow: the pods themselves, and other verbs, are still allowed.
    assert!(allowed(&api, review("create", "", "pods", "", "")).await.0);
    assert!(allowed(&api, review("delete", "", "pods", "", "")).await.0);

    // Any verb on events in one namespace, with a reason of its own.
    d.deny_access(
        AccessRule {
            verb: Some("*".into()),
            ..AccessRule::deny("", "events.k8s.io", "events")
        }
        .namespace("default")
        .reason("no events for you"),
    );
    assert_eq!(
        allowed(
            &api,
            review("patch", "events.k8s.io", "events", "", "default")
        )
        .await,
        (false, "no events for you".into())
    );
    assert!(
        allowed(
            &api,
            review("patch", "events.k8s.io", "events", "", "kube-system")
        )
        .await
        .0
    );

    // The control call replaces the list; GET shows it.
    let put = http::Request::put("/_double/access")
        .header("content-type", "application/json")
        .body(
            serde_json::to_vec(
                &json!({"deny": [{"verb": "patch", "resource": "nodes", "subresource": "status"}]}),
            )
            .unwrap(),
        )
        .unwrap();
    let answer = client.request_text(put).await.unwrap();
    assert!(answer.contains("\"deny\":1"), "{answer}");
    assert!(
        allowed(&api, review("create", "", "pods", "eviction", ""))
            .await
            .0,
        "replaced"
    );
    assert!(
        !allowed(&api, review("patch", "", "nodes", "status", ""))
            .await
            .0
    );
    assert!(allowed(&api, review("patch", "", "nodes", "", "")).await.0);
    assert_eq!(d.access_rules().len(), 1);

    // A review is answered, never stored; the request log has it.
    assert!(d.requests().iter().any(|r| r.method == "POST"
        && r.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        && r.status == 201));

    // Neither resource nor non-resource attributes: 422.
    let e = api
        .create(&PostParams::default(), &SelfSubjectAccessReview::default())
        .await
        .unwrap_err();
    match e {
        kube::Error::Api(s) => assert_eq!(s.code, 422),
        other => panic!("{other}"),
    }

    // Faults apply to it like to any path.
    d.inject(Fault::status(503).path_prefix("/apis/authorization.k8s.io/"));
    assert!(api
        .create(&PostParams::default(), &review("get", "", "nodes", "", ""))
        .await
        .is_err());
}
