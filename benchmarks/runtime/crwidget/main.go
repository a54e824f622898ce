// The Widget controller of benchmarks/runtime on Go controller-runtime: for each Widget,
// server-side apply its ConfigMap "<name>-data" (data.value = spec.value, owned by the Widget),
// then apply status {observedGeneration, value}. Like the other controllers in the benchmark it
// compares with the cache and writes only what differs.
//
// Built at bench time in a throwaway module (benchmarks/runtime/golang.py); never shipped.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"os"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
)

const fieldOwner = client.FieldOwner("widget-controller")

var widgetGVK = schema.GroupVersionKind{Group: "test.tailnet.dev", Version: "v1", Kind: "Widget"}

type reconciler struct{ client.Client }

func (r *reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	w := &unstructured.Unstructured{}
	w.SetGroupVersionKind(widgetGVK)
	if err := r.Get(ctx, req.NamespacedName, w); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	value, _, _ := unstructured.NestedString(w.Object, "spec", "value")

	cm := &corev1.ConfigMap{}
	err := r.Get(ctx, types.NamespacedName{Namespace: req.Namespace, Name: req.Name + "-data"}, cm)
	if err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, err
	}
	if err != nil || cm.Data["value"] != value {
		body, _ := json.Marshal(map[string]any{
			"apiVersion": "v1", "kind": "ConfigMap",
			"metadata": map[string]any{
				"name": req.Name + "-data", "namespace": req.Namespace,
				"ownerReferences": []metav1.OwnerReference{{
					APIVersion: "test.tailnet.dev/v1", Kind: "Widget", Name: w.GetName(), UID: w.GetUID(),
					Controller: ptr(true), BlockOwnerDeletion: ptr(true),
				}},
			},
			"data": map[string]string{"value": value},
		})
		target := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: req.Name + "-data", Namespace: req.Namespace}}
		if err := r.Patch(ctx, target, client.RawPatch(types.ApplyPatchType, body), fieldOwner, client.ForceOwnership); err != nil {
			return ctrl.Result{}, err
		}
	}

	observed, _, _ := unstructured.NestedInt64(w.Object, "status", "observedGeneration")
	current, _, _ := unstructured.NestedString(w.Object, "status", "value")
	if observed != w.GetGeneration() || current != value {
		body, _ := json.Marshal(map[string]any{
			"apiVersion": "test.tailnet.dev/v1", "kind": "Widget",
			"metadata": map[string]any{"name": req.Name, "namespace": req.Namespace},
			"status":   map[string]any{"observedGeneration": w.GetGeneration(), "value": value},
		})
		if err := r.Status().Patch(ctx, w, client.RawPatch(types.ApplyPatchType, body), fieldOwner, client.ForceOwnership); err != nil {
			return ctrl.Result{}, err
		}
	}
	return ctrl.Result{}, nil
}

func cacheOptions(namespace string) cache.Options {
	if namespace == "" {
		return cache.Options{}
	}
	return cache.Options{DefaultNamespaces: map[string]cache.Config{namespace: {}}}
}

func ptr[T any](v T) *T { return &v }

func main() {
	workers := flag.Int("workers", 8, "concurrent reconciles")
	namespace := flag.String("namespace", "", "watch only this namespace (default: all)")
	flag.Parse()
	cfg := ctrl.GetConfigOrDie()
	cfg.QPS, cfg.Burst = -1, 0 // no client-side rate limit: the apiserver is the limit, as for the others
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Metrics: metricsserver.Options{BindAddress: "0"},
		Client:  client.Options{Cache: &client.CacheOptions{Unstructured: true}},
		Cache:   cacheOptions(*namespace),
	})
	if err != nil {
		panic(err)
	}
	w := &unstructured.Unstructured{}
	w.SetGroupVersionKind(widgetGVK)
	err = ctrl.NewControllerManagedBy(mgr).
		For(w, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&corev1.ConfigMap{}).
		WithOptions(controller.Options{MaxConcurrentReconciles: *workers}).
		Complete(&reconciler{mgr.GetClient()})
	if err != nil {
		panic(err)
	}
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}
